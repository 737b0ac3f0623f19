"""Hardware and model profiles (data in `orchestrator/profiles/*.toml`) and the cost model.

The cost model turns a (hardware, target model, draft model, quantisation) choice into the
unit times the simulator charges. All of it is roofline arithmetic on the profile numbers:

    device expert, n tokens    max(W_e / B_gpu, n·F_e / P_gpu)     W_e expert bytes, F_e = 2·params
    host expert, n tokens      max(W_e / B_cpu, n·F_e / P_cpu)     weights streamed once per pass
    copy one expert            W_e / B_pcie
    dense part of a block      W_block / B_gpu + layer overhead    (attention, router, shared experts)
                               + a hybrid's recurrent state: read once, and per token of the pass
                               a snapshot written and copied into the cache (3 state bytes)
    output head                W_head / B_gpu
    one draft token            W_draft / B_gpu + n_block_draft · layer overhead
                               (spac's pool draft and MTP head: the target's own weights, `_self_draft`)

with every B and P the profile's peak times its efficiency. A hybrid target (Qwen3.5/3.6-MoE:
gated-delta-net blocks beside full-attention ones) has KV only in its full-attention blocks
(kv_bytes_per_token) and in device memory a recurrent state per delta-net block, 1 + n_rs_seq
of them (llama.cpp keeps n_rs_seq snapshots for rollback: spac asks for γ when speculating).

A measured profile (`spac sim profile measure`, `MeasuredProfile`, a TOML file of its own
format) gives the same unit times from timed passes of the patched engine instead of datasheet
rates, each per byte of the weights it reads so that it carries over to another model shape:

    expert, n tokens (host, device)   W_e · s_per_byte(n), a table over n = 1, 2, 4 .. γ+1,
                                      linear between and beyond its points
    copy one expert (a plan's)        latency + W_e / bytes_per_s
    copy one expert inside a pass     latency + W_e / stage.bytes_per_s, and stage.batch_s once per
                                      layer that copies (uploads on miss and the miss gate's go
                                      through the staging queue, a layer's as one batch)
    non-expert part of a pass         W_ne · (s_per_byte + n · s_per_byte_token)  on the device
    crossing                          per split layer, every pass: the engine's graph splits
                                      every MoE layer whatever the residency
    absent experts on the device      one zero-slot expert with their tokens (a device that does
                                      not skip id -1 multiplies them by the all-zero slot)
    one draft token                   measured on the draft file, else its bytes at the draft rate
    the disk (optional)               read rate, latency, queue depth (sim/disk.py), for a host
                                      tier smaller than the experts (sim/host_tier.py)

Why ~800 lines: the cost model's every term reads one field of a hardware or model profile, so
the profiles, their TOML loading, the cost model (with the drafts made of the target itself,
`_self_draft`) and the measured profile (`read_measured`,
`write_measured`: what `spac sim profile measure` writes) and a GGUF's model profile
(`from_gguf`) are kept in one module; the measuring itself is cli/profile_measure.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

from orchestrator.gguf_files.model_sizes import model_sizes, recurrent_layers
from orchestrator.sim.disk import Disk

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency on 3.10 only)
    import tomli as tomllib

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"

# bits per weight of ggml block formats (ggml/src/ggml-common.h block sizes)
BITS_PER_WEIGHT = {
    "Q4_K": 144 * 8 / 256,   # block_q4_K: 2 halves + 12 scale bytes + 128 quant bytes per 256
    "Q6_K": 210 * 8 / 256,   # block_q6_K
    "Q8_0": 34 * 8 / 32,     # block_q8_0: 1 half + 32 bytes per 32
    "MXFP4": 17 * 8 / 32,    # block_mxfp4: 1 scale byte + 16 bytes per 32
    "Q4_0": 18 * 8 / 32,     # block_q4_0: 1 half + 16 bytes per 32
    "F16": 16.0,
    "BF16": 16.0,
}


def _disk(read_gbps: float, latency_us: float, queue_depth: int) -> Disk:
    """A disk from hardware.toml's units (GB/s, µs)."""
    return Disk(read_gbps * 1e9, latency_us * 1e-6, max(int(queue_depth), 1))


@dataclass(frozen=True)
class HardwareProfile:
    key: str
    name: str
    vram_GB: float
    gpu_mem_GBps: float
    gpu_efficiency: float
    pcie_GBps: float
    pcie_efficiency: float
    cpu_mem_GBps: float
    cpu_efficiency: float
    cpu_gflops: float
    layer_overhead_us: float
    sync_us: float
    gpu_tflops: float = 80.0  # not a bottleneck at ≤ 16 verified tokens; kept out of the TOML
    prefill_tflops: float = 0.0  # the GPU's effective rate in prompt processing (spac sim prefill; 0: none given)
    n_devices: int = 1        # cards of this kind, layers split in contiguous ranges; vram_GB and pcie_GBps are per card
    # the first of the n_devices cards is in another machine (ggml RPC), reached over a network
    # link of this effective bandwidth and one-way latency (0: every card is local)
    remote_GBps: float = 0.0
    remote_latency_us: float = 0.0
    # the disk below the host RAM (sim/disk.py); 0: not given (a --disk preset, else DEFAULT_DISK)
    disk_read_gbps: float = 0.0
    disk_latency_us: float = 0.0
    disk_queue_depth: int = 0

    def disk(self) -> Disk | None:
        return _disk(self.disk_read_gbps, self.disk_latency_us, self.disk_queue_depth) if self.disk_read_gbps else None

    @property
    def gpu_bw(self) -> float:
        return self.gpu_mem_GBps * self.gpu_efficiency * 1e9

    @property
    def pcie_bw(self) -> float:
        return self.pcie_GBps * self.pcie_efficiency * 1e9

    @property
    def cpu_bw(self) -> float:
        return self.cpu_mem_GBps * self.cpu_efficiency * 1e9

    def expert_copy_s(self, expert_bytes: float) -> float:
        """Time per copied expert over all the cards' links, the copies spread over the cards in
        proportion to their layers (equal cards: equal shares), each link copying its share back
        to back while the others do theirs. A remote card's link is the network (bandwidth and
        one-way latency per copy); a local card's is its PCIe link."""
        n = max(self.n_devices, 1)
        local = expert_bytes / self.pcie_bw
        if not self.remote_GBps:
            return local / n
        remote = self.remote_latency_us * 1e-6 + expert_bytes / (self.remote_GBps * 1e9)
        return max(local, remote) / n

    def remote_crossing(self, d_model: int) -> tuple[float, float]:
        """(seconds, seconds per token) a remote card adds to each of its MoE layers: the hidden
        state goes to the host, where the layer's host half runs, and back (F32, both ways)."""
        if not self.remote_GBps:
            return 0.0, 0.0
        return 2 * self.remote_latency_us * 1e-6, 2 * 4 * d_model / (self.remote_GBps * 1e9)


@dataclass(frozen=True)
class ModelProfile:
    key: str
    name: str
    source: str
    n_block: int
    d_model: int
    block_params: int
    head_params: int
    kv_bytes_per_token: int
    moe_blocks: tuple[int, int] | None = None
    n_expert: int = 0
    top_k: int = 0
    expert_params: int = 0
    dense_block_params: int = 0
    draft: bool = False
    tie_embeddings: bool = False
    recurrent_blocks: int = 0  # hybrid: blocks with a recurrent state instead of a KV cache
    state_bytes: int = 0       # hybrid: one sequence's recurrent state over those blocks (F32)
    mtp_block_params: int = 0  # the MTP block's weights besides its routed experts (0: no MTP block)

    @property
    def n_layer(self) -> int:
        """MoE layers (the layers a routing trace has)."""
        return 0 if self.moe_blocks is None else self.moe_blocks[1] - self.moe_blocks[0] + 1

    @property
    def n_dense_block(self) -> int:
        return self.n_block - self.n_layer

    @property
    def layer_index(self) -> list[int]:
        return [] if self.moe_blocks is None else list(range(self.moe_blocks[0], self.moe_blocks[1] + 1))

    @property
    def params(self) -> int:
        return (self.n_layer * (self.n_expert * self.expert_params + self.block_params)
                + self.n_dense_block * (self.dense_block_params or self.block_params)
                + (1 if self.tie_embeddings else 2) * self.head_params)

    def expert_bytes(self, quant: str = "Q4_K") -> float:
        return self.expert_params * BITS_PER_WEIGHT[quant] / 8

    def non_expert_bytes(self, quant: str = "Q4_K") -> float:
        """Weights read by every forward pass besides the routed experts (blocks + head)."""
        dense = self.n_dense_block * (self.dense_block_params or self.block_params)
        return (self.n_layer * self.block_params + dense + self.head_params) * BITS_PER_WEIGHT[quant] / 8

    def state_memory(self, snapshots: int = 0) -> float:
        """A hybrid's recurrent states in memory: the current one and n_rs_seq = `snapshots`."""
        return self.state_bytes * (1 + snapshots)

    def state_traffic(self) -> tuple[float, float]:
        """(bytes per pass, bytes per token of the pass) of recurrent state one MoE block moves, on
        average: each delta-net block reads its state once and writes a snapshot per token, which
        is then copied into the cache (llama.cpp's build_recurrent_attn with n_rs_seq ≥ the
        pass's tokens; with n_rs_seq 0 one token writes the one state the same way)."""
        per_block = self.state_bytes / max(self.n_layer, 1)
        return per_block, 3 * per_block


def _load(name: str) -> dict:
    with open(PROFILE_DIR / name, "rb") as f:
        return tomllib.load(f)


# drafts spac makes of the target itself (`--draft pool|mtp`), named where a draft model profile would be
SELF_DRAFTS = ("pool", "mtp")
# the tokens of an MTP step's first decode: the accepted drafts and the target's own token (about 3
# at γ 4 and a per-token acceptance of 0.75: 1 + 0.75 + 0.75² + 0.75³ + 0.75⁴ ≈ 3.05)
MTP_CATCH_UP_TOKENS = 3

DISKS = "disks"  # hardware.toml's table of disk presets, beside the hardware profiles
DEFAULT_DISK = "nvme-pcie4"  # where neither --disk nor the hardware profile names one


@lru_cache(maxsize=None)
def hardware_profiles() -> dict[str, HardwareProfile]:
    return {k: HardwareProfile(key=k, **v) for k, v in _load("hardware.toml").items() if k != DISKS}


@lru_cache(maxsize=None)
def disk_presets() -> dict[str, tuple[str, Disk]]:
    """{key: (name, Disk)} from hardware.toml's [disks.*] tables (the same disk_* fields)."""
    return {k: (v["name"], _disk(v["disk_read_gbps"], v["disk_latency_us"], v["disk_queue_depth"]))
            for k, v in _load("hardware.toml").get(DISKS, {}).items()}


def disk(key: str) -> Disk:
    try:
        return disk_presets()[key][1]
    except KeyError:
        raise KeyError(f"unknown disk {key!r}; known: {', '.join(disk_presets())}") from None


@lru_cache(maxsize=None)
def model_profiles() -> dict[str, ModelProfile]:
    known = {f.name for f in fields(ModelProfile)}
    out = {}
    for k, v in _load("models.toml").items():
        extra = set(v) - known
        if extra:
            raise ValueError(f"models.toml [{k}]: unknown field(s) {sorted(extra)}")
        if "moe_blocks" in v:
            v = {**v, "moe_blocks": tuple(v["moe_blocks"])}
        out[k] = ModelProfile(key=k, **v)
    return out


def hardware(key: str) -> HardwareProfile:
    try:
        return hardware_profiles()[key]
    except KeyError:
        raise KeyError(f"unknown hardware profile {key!r}; known: {', '.join(hardware_profiles())}") from None


def model(key: str) -> ModelProfile:
    try:
        return model_profiles()[key]
    except KeyError:
        raise KeyError(f"unknown model profile {key!r}; known: {', '.join(model_profiles())}") from None


@dataclass(frozen=True)
class CostModel:
    """Unit times in seconds (see the module docstring). Build with `CostModel.build` or by hand."""

    expert_bytes: float
    expert_flops: float
    gpu_bw: float
    gpu_flops: float
    cpu_bw: float
    cpu_flops: float
    pcie_bw: float
    dense_layer_s: float      # one MoE block's non-expert part, whole verify pass
    fixed_pass_s: float       # per pass besides the MoE blocks: dense blocks and output head
    draft_token_s: float      # one draft token (0: no draft cost)
    sync_s: float             # per layer that has a host half
    draft_step_s: float = 0.0 # once per step that drafts, besides its draft tokens (the MTP head's catch-up)
    vram_bytes: float = float("inf")
    static_bytes: float = 0.0  # device memory that is not the expert pool (weights, draft, KV)
    # measured profiles (defaults: the datasheet roofline above)
    gpu_table: tuple | None = None   # ((tokens...), (seconds of one expert...)): replaces the roofline
    cpu_table: tuple | None = None
    dense_layer_token_s: float = 0.0  # dense_layer_s grows by this per token of the pass
    fixed_pass_token_s: float = 0.0   # fixed_pass_s grows by this per token of the pass
    sync_token_s: float = 0.0         # sync_s grows by this per token of the pass (a network link's bytes)
    # attention over the KV cache: one block's time per token of context, per pass and per token of
    # the pass (reading the cache, and each token's dot products with it); 0 without a measurement
    attention_block_s: float = 0.0
    attention_block_token_s: float = 0.0
    n_dense_block: int = 0            # blocks without experts, whose attention is in fixed_pass_time
    sync_every_layer: bool = False   # the crossing is paid by every MoE layer, not only those with a host half
                                     # (spac's split graph; never with a pool of every expert)
    zero_slot: bool = False          # the device computes absent experts' tokens with the all-zero slot
    transfer_latency_s: float = 0.0  # per copied expert, on top of its bytes over pcie_bw
    overlap: bool = True             # the device half runs while the host half does (False: a CPU test device)
    sync_on_device: bool = False     # the crossing delays the device half (layers on the host), not the host half
    sync_serial_s: float = 0.0       # the part of sync_s both halves wait for: the hidden state reaching the
                                     # host before the device half is queued (layers on the device)
    copy_blocks_device: bool = False  # copies and device compute share one worker (an RPC server): the
                                      # copies queued before a pass take device time in it
    # copies made inside a pass (uploads on miss, the miss gate's): their own path, the staging
    # queue, one batch per layer (None: as a plan's copies, pcie_bw and no batch cost)
    stage_bw: float | None = None
    stage_batch_s: float = 0.0        # once per layer of a pass that copies inside it
    disk: Disk | None = None          # below the host RAM (a host tier smaller than the experts reads from it)

    @classmethod
    def build(
        cls,
        hw: HardwareProfile,
        target: ModelProfile,
        draft: ModelProfile | str | None = None,
        quant: str = "Q4_K",
        draft_quant: str = "Q8_0",
        context: int = 4096,
        snapshots: int = 0,
    ) -> CostModel:
        """draft: a model profile, or one of SELF_DRAFTS; snapshots: a hybrid target's n_rs_seq
        (recurrent states kept for rollback)."""
        bpw = BITS_PER_WEIGHT[quant] / 8
        overhead = hw.layer_overhead_us * 1e-6
        state_pass, state_token = target.state_traffic()
        dense_layer = (target.block_params * bpw + state_pass) / hw.gpu_bw + overhead
        dense_blocks = target.n_dense_block * ((target.dense_block_params or target.block_params) * bpw / hw.gpu_bw + overhead)
        head = target.head_params * bpw / hw.gpu_bw
        static = target.non_expert_bytes(quant) + context * target.kv_bytes_per_token + target.state_memory(snapshots)
        draft_s = draft_step_s = 0.0
        if isinstance(draft, str):  # a draft made of the target itself
            draft_s, draft_step_s, draft_static = _self_draft(draft, hw, target, quant, context)
            static += draft_static
        elif draft is not None:
            draft_bytes = (draft.n_block * draft.block_params + draft.head_params) * BITS_PER_WEIGHT[draft_quant] / 8
            draft_s = draft_bytes / hw.gpu_bw + draft.n_block * overhead
            # a hybrid draft's context keeps two sequences' states (spac's scratch sequence for drafting)
            static += draft_bytes + context * draft.kv_bytes_per_token + 2 * draft.state_bytes
        # several cards (layer split): their memory adds up; each copies over its own link, and
        # with the pool's slots spread over the layers so are the copies (so the links add up);
        # the cards compute one after the other, the hidden state crossing once per card boundary
        n_dev = max(hw.n_devices, 1)
        sync, sync_token, fixed, fixed_token = hw.sync_us * 1e-6, 0.0, 0.0, 0.0
        if hw.remote_GBps:
            # a remote card (first in the split, so that the output head and its logits stay on a
            # local card): each of its MoE layers crosses the network to the host half and back,
            # charged here as an average over all layers; the pass's input crosses to it once
            # and its output comes back once
            per_layer, per_token = hw.remote_crossing(target.d_model)
            sync, sync_token = sync + per_layer / n_dev, per_token / n_dev
            fixed, fixed_token = per_layer, per_token
        return cls(
            expert_bytes=target.expert_bytes(quant), expert_flops=2.0 * target.expert_params,
            gpu_bw=hw.gpu_bw, gpu_flops=hw.gpu_tflops * 1e12, cpu_bw=hw.cpu_bw, cpu_flops=hw.cpu_gflops * 1e9,
            pcie_bw=(hw.pcie_bw * n_dev if not hw.remote_GBps
                     else target.expert_bytes(quant) / hw.expert_copy_s(target.expert_bytes(quant))),
            dense_layer_s=dense_layer, dense_layer_token_s=state_token / hw.gpu_bw,
            fixed_pass_s=dense_blocks + head + (n_dev - 1) * hw.sync_us * 1e-6 + fixed, fixed_pass_token_s=fixed_token,
            draft_token_s=draft_s, draft_step_s=draft_step_s, sync_s=sync, sync_token_s=sync_token,
            vram_bytes=hw.vram_GB * 1e9 * n_dev, static_bytes=static, disk=hw.disk(),
        )

    @classmethod
    def from_measured(
        cls,
        hw: MeasuredProfile,
        target: ModelProfile,
        draft: ModelProfile | None = None,
        quant: str = "Q4_K",
        draft_quant: str = "Q8_0",
        context: int = 4096,
        draft_file: str | None = None,
        snapshots: int = 0,
    ) -> CostModel:
        """Unit times of `target` (and `draft`) on a measured machine (module docstring); a hybrid's
        recurrent state moves at the rate of the non-expert weights' bytes."""
        if isinstance(draft, str):
            raise ValueError(f"draft {draft!r}: a measured profile times a draft file; spac's drafts made of "
                             "the target are modelled on datasheet profiles only")
        w_e = target.expert_bytes(quant)
        host, device = hw.expert_rate("host", quant), hw.expert_rate("device", quant)
        # the roofline fields, kept consistent for readers of them: stream = the one-token time,
        # per-token flops from the table's last step
        def roof(table):
            n, s = table
            slope = (s[-1] - s[-2]) / (n[-1] - n[-2]) if len(n) > 1 else s[0]
            return 1.0 / max(s[0], 1e-30), 2.0 * target.expert_params / max(w_e * slope, 1e-30)
        ne = target.non_expert_bytes(quant)
        head = target.head_params * BITS_PER_WEIGHT[quant] / 8
        share = (ne - head) / target.n_layer / ne if target.n_layer and ne else 0.0  # one MoE block's part
        dense = target.n_dense_block * (target.dense_block_params or target.block_params) * BITS_PER_WEIGHT[quant] / 8
        fixed_share = (head + dense) / ne if ne else 0.0
        per_pass, per_token = ne * hw.non_expert_s_per_byte, ne * hw.non_expert_s_per_byte_token
        kv_block = target.kv_bytes_per_token / max(target.n_block, 1)  # one block's cache per token of context
        static = ne + context * target.kv_bytes_per_token + target.state_memory(snapshots)
        state_pass, state_token = (b * hw.non_expert_s_per_byte for b in target.state_traffic())
        draft_s = 0.0
        if draft is not None:
            draft_bytes = _draft_token_bytes(draft, draft_quant)
            if draft_file is not None and hw.draft_file and Path(draft_file).name == hw.draft_file:
                draft_s = hw.draft_s_per_token
            else:
                draft_s = draft_bytes * hw.draft_s_per_byte
            static += context * draft.kv_bytes_per_token + 2 * draft.state_bytes
        (gpu_bw, gpu_flops), (cpu_bw, cpu_flops) = roof(device), roof(host)
        return cls(
            expert_bytes=w_e, expert_flops=2.0 * target.expert_params,
            gpu_bw=gpu_bw, gpu_flops=gpu_flops, cpu_bw=cpu_bw, cpu_flops=cpu_flops,
            gpu_table=(tuple(device[0]), tuple(w_e * x for x in device[1])),
            cpu_table=(tuple(host[0]), tuple(w_e * x for x in host[1])),
            pcie_bw=hw.copy_bytes_per_s, transfer_latency_s=hw.copy_latency_s,
            stage_bw=hw.stage_bytes_per_s or None, stage_batch_s=hw.stage_batch_s,
            dense_layer_s=share * per_pass + state_pass, dense_layer_token_s=share * per_token + state_token,
            fixed_pass_s=fixed_share * per_pass, fixed_pass_token_s=fixed_share * per_token,
            attention_block_s=kv_block * hw.kv_s_per_byte, attention_block_token_s=kv_block * hw.kv_s_per_byte_token,
            n_dense_block=target.n_dense_block,
            draft_token_s=draft_s, sync_s=hw.crossing_s, sync_every_layer=True, zero_slot=hw.zero_slot,
            overlap=hw.overlap, sync_on_device=hw.non_expert_on == "host", copy_blocks_device=hw.copy_blocks_device,
            # layers on the device: the host half's inputs come first in the graph, so the device
            # half is queued only once the hidden state has reached the host (one way of the two)
            sync_serial_s=hw.crossing_s / 2 if hw.non_expert_on == "device" else 0.0,
            vram_bytes=hw.vram_GB * 1e9, static_bytes=static, disk=hw.disk,
        )

    def draft_time(self, n_drafted: int) -> float:
        """A step's drafting of n_drafted tokens."""
        return n_drafted * self.draft_token_s + (self.draft_step_s if n_drafted else 0.0)

    @property
    def transfer_s(self) -> float:
        """One expert copied by a plan (the copy worker, between and beside passes)."""
        return self.transfer_latency_s + self.expert_bytes / self.pcie_bw

    @property
    def fetch_s(self) -> float:
        """One expert copied inside a pass (uploads on miss, the miss gate's), besides its layer's
        stage_batch_s."""
        return self.transfer_latency_s + self.expert_bytes / (self.stage_bw or self.pcie_bw)

    def attention_time(self, n_tokens: int, position: int) -> float:
        """One block's attention over `position` tokens of KV cache, for a pass of n_tokens tokens."""
        return position * (self.attention_block_s + n_tokens * self.attention_block_token_s)

    def dense_layer_time(self, n_tokens: int, position: int = 0) -> float:
        """One MoE block's non-expert part in a pass of n_tokens tokens after `position` cached ones."""
        return self.dense_layer_s + n_tokens * self.dense_layer_token_s + self.attention_time(n_tokens, position)

    def fixed_pass_time(self, n_tokens: int, position: int = 0) -> float:
        """A pass's dense blocks and output head at n_tokens tokens after `position` cached ones."""
        return (self.fixed_pass_s + n_tokens * self.fixed_pass_token_s
                + self.n_dense_block * self.attention_time(n_tokens, position))

    def gpu_expert_s(self, n_tokens):
        """Device time of experts with n_tokens tokens each (array or scalar)."""
        return self._expert(self.expert_bytes / self.gpu_bw, self.expert_flops / self.gpu_flops, n_tokens, self.gpu_table)

    def zero_slots_s(self, n_tokens: int, top_k: int) -> float:
        """Device time of the absent experts' n_tokens (token, expert) pairs on a device pool: one
        zero slot per top-k position (patch 0013), so up to top_k distinct zero experts share them."""
        k = max(min(int(n_tokens), int(top_k)), 1)
        return k * float(self.gpu_expert_s(-(-int(n_tokens) // k)))

    def cpu_expert_s(self, n_tokens):
        """Host time of experts with n_tokens tokens each (array or scalar)."""
        return self._expert(self.expert_bytes / self.cpu_bw, self.expert_flops / self.cpu_flops, n_tokens, self.cpu_table)

    @staticmethod
    def _expert(stream_s: float, token_s: float, n_tokens, table):
        import numpy as np

        n = np.asarray(n_tokens, dtype=np.float64)
        if table is None:
            return np.maximum(stream_s, n * token_s)
        return table_time(table, n)


def table_time(table, n):
    """Piecewise-linear time at n tokens through the (tokens, seconds) points, extended beyond the
    last point along its last segment (0 tokens: nothing to do)."""
    import numpy as np

    xs, ys = (np.asarray(v, dtype=np.float64) for v in table)
    t = np.interp(n, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        t = np.where(n > xs[-1], ys[-1] + (n - xs[-1]) * slope, t)
    return np.where(n > 0, t, 0.0)


def _self_draft(kind: str, hw: HardwareProfile, target: ModelProfile, quant: str,
                context: int) -> tuple[float, float, float]:
    """(seconds per draft token, seconds once per drafting step, device bytes) of a draft spac makes
    of the target itself (design.md, "The pool draft" and "The MTP draft"):
    - pool: the target's pass over one token with the device half alone (patch 0009): every block
      and the head, top_k device experts per MoE layer, no crossing; a second context of the
      target's shape in device memory (its KV cache, a hybrid's two recurrent states).
    - mtp: the target's MTP block: its non-expert part on the device, its top_k experts on the host
      (patch 0020 keeps them out of the pool) behind one crossing, and the output head; its weights
      and one full-attention block's KV cache in device memory. A step's first decode also catches
      up on the tokens accepted since the last one: MTP_CATCH_UP_TOKENS tokens' experts, not one."""
    bpw = BITS_PER_WEIGHT[quant] / 8
    overhead = hw.layer_overhead_us * 1e-6
    flops = 2.0 * target.expert_params
    if kind == "pool":
        state_pass, state_token = target.state_traffic()
        expert = max(target.expert_bytes(quant) / hw.gpu_bw, flops / (hw.gpu_tflops * 1e12))
        blocks = target.non_expert_bytes(quant) + target.n_layer * (state_pass + state_token)
        token_s = blocks / hw.gpu_bw + target.n_block * overhead + target.n_layer * target.top_k * expert
        return token_s, 0.0, context * target.kv_bytes_per_token + 2 * target.state_bytes
    if kind == "mtp":
        if not target.mtp_block_params:
            raise ValueError(f"{target.name} has no MTP block (mtp_block_params in models.toml)")
        host_expert = max(target.expert_bytes(quant) / hw.cpu_bw, flops / (hw.cpu_gflops * 1e9))
        block = target.mtp_block_params * bpw
        token_s = ((block + target.head_params * bpw) / hw.gpu_bw + overhead + hw.sync_us * 1e-6
                   + target.top_k * host_expert)
        kv_block = target.kv_bytes_per_token / max(target.n_block - target.recurrent_blocks, 1)
        return token_s, (MTP_CATCH_UP_TOKENS - 1) * target.top_k * host_expert, block + context * kv_block
    raise ValueError(f"unknown draft {kind!r}: a model profile or one of {', '.join(SELF_DRAFTS)}")


def _draft_token_bytes(draft: ModelProfile, quant: str) -> float:
    """Weights one draft token reads: every block (with its top-k experts for an MoE draft) and the head."""
    per_block = draft.block_params + (draft.top_k * draft.expert_params if draft.n_expert and not draft.draft else 0)
    return (draft.n_block * per_block + draft.head_params) * BITS_PER_WEIGHT[quant] / 8


# ---------------------------------------------------------------------------- measured profiles

MEASURED_FORMAT = "spac-measured-profile"
MEASURED_VERSION = 1


@dataclass(frozen=True)
class MeasuredProfile:
    """A machine measured by `spac sim profile measure` (file format: `write_measured`).

    Rates are seconds per byte of the weights read. `host`/`device`: {type: ((tokens...),
    (s_per_byte...))}: one expert's matmuls (MUL_MAT_ID, the kernels and layouts spac runs) with
    that many tokens, per byte of the expert. Non-expert part of a pass of n tokens after p tokens
    of context: bytes · (s_per_byte + n · s_per_byte_token) + p · KV bytes per token ·
    (kv_s_per_byte + n · kv_s_per_byte_token): attention reads the cache once per pass and every
    token of the pass computes with all of it. Per KV byte is exact for models with the measured
    model's ratio of query heads to KV heads (the compute part scales with query heads)."""

    key: str
    name: str
    cpu: str
    device: str
    host_threads: int
    vram_GB: float
    host: dict
    device_rates: dict
    copy_bytes_per_s: float
    copy_latency_s: float
    crossing_s: float
    non_expert_s_per_byte: float
    non_expert_s_per_byte_token: float
    draft_s_per_byte: float
    kv_s_per_byte: float = 0.0        # 0: not measured (a profile from before it was)
    kv_s_per_byte_token: float = 0.0
    draft_s_per_token: float = 0.0
    draft_file: str = ""
    zero_slot: bool = True
    overlap: bool = True   # False: the pool device shares the host's threads (the CPU test device)
    non_expert_on: str = "device"  # where the measured passes ran the layers' non-expert weights
    copy_blocks_device: bool = False  # the device computes and receives copies on the same thread(s)
    measured_with: str = ""
    measured_at: str = ""
    check: dict = field(default_factory=dict)
    disk: Disk | None = None  # the disk the profile was measured with (--disk-file), None: not measured
    # copies inside a pass (the staging queue): bytes / stage_bytes_per_s, plus stage_batch_s per
    # layer that copies (fitted over the cache ablation's layers, each a batch, misses or not);
    # 0: not measured (a profile from before), as a plan's copies
    stage_bytes_per_s: float = 0.0
    stage_batch_s: float = 0.0

    def expert_rate(self, side: str, quant: str) -> tuple[tuple, tuple]:
        """((tokens...), (s_per_byte...)) of `quant` experts on "host" or "device"; a type that was
        not measured takes the rate of the measured type with the closest bits per weight."""
        rates = self.host if side == "host" else self.device_rates
        if quant in rates:
            return tuple(rates[quant])
        bpw = BITS_PER_WEIGHT.get(quant, 16.0)
        near = min(rates, key=lambda q: abs(BITS_PER_WEIGHT.get(q, 16.0) - bpw))
        return tuple(rates[near])


def read_measured(path: str | Path) -> MeasuredProfile:
    """Load a measured profile; ValueError says what is wrong with the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: cannot read a measured profile ({e})") from None
    p = data.get("profile", {})
    if p.get("format") != MEASURED_FORMAT:
        raise ValueError(f"{path}: not a {MEASURED_FORMAT} file (no [profile] format = \"{MEASURED_FORMAT}\")")
    if p.get("version") != MEASURED_VERSION:
        raise ValueError(f"{path}: version {p.get('version')}, this reader knows {MEASURED_VERSION}")
    try:
        def rates(side):
            out = {q: (tuple(int(n) for n in v["tokens"]), tuple(float(x) for x in v["s_per_byte"]))
                   for q, v in data[side].items()}
            if not out:
                raise ValueError(f"[{side}] has no weight type")
            for q, (n, x) in out.items():
                if not n or len(n) != len(x) or list(n) != sorted(set(n)) or n[0] < 1:
                    raise ValueError(f"[{side}.{q}]: tokens must be increasing from 1 or more, one s_per_byte each")
            return out

        prof = MeasuredProfile(
            key=str(path), name=p["name"], cpu=p.get("cpu", ""), device=p["device"],
            host_threads=int(p.get("host_threads", 0)), vram_GB=float(p["vram_GB"]),
            host=rates("host"), device_rates=rates("device"),
            copy_bytes_per_s=float(data["copy"]["bytes_per_s"]), copy_latency_s=float(data["copy"]["latency_s"]),
            crossing_s=float(data["crossing"]["s"]),
            non_expert_s_per_byte=float(data["non_expert"]["s_per_byte"]),
            non_expert_s_per_byte_token=float(data["non_expert"]["s_per_byte_token"]),
            kv_s_per_byte=float(data["non_expert"].get("s_per_kv_byte", 0.0)),
            kv_s_per_byte_token=float(data["non_expert"].get("s_per_kv_byte_token", 0.0)),
            draft_s_per_byte=float(data["draft"]["s_per_byte"]),
            draft_s_per_token=float(data["draft"].get("s_per_token", 0.0)),
            draft_file=str(data["draft"].get("file", "")), zero_slot=bool(p.get("zero_slot", True)),
            overlap=bool(p.get("overlap", True)), non_expert_on=str(p.get("non_expert_on", "device")),
            copy_blocks_device=bool(p.get("copy_blocks_device", False)),
            measured_with=str(p.get("measured_with", "")), measured_at=str(p.get("measured_at", "")),
            check=dict(data.get("check", {})),
            stage_bytes_per_s=float(data.get("stage", {}).get("bytes_per_s", 0.0)),
            stage_batch_s=float(data.get("stage", {}).get("batch_s", 0.0)),
            disk=Disk(float(data["disk"]["read_bytes_per_s"]), float(data["disk"]["latency_s"]),
                      int(data["disk"]["queue_depth"])) if "disk" in data else None)
    except KeyError as e:
        raise ValueError(f"{path}: missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    disk_rate = prof.disk.read_bytes_per_s if prof.disk is not None else 1.0
    for name, v in (("copy.bytes_per_s", prof.copy_bytes_per_s), ("crossing.s", prof.crossing_s + 1),
                    ("disk.read_bytes_per_s", disk_rate)):
        if not v > 0:
            raise ValueError(f"{path}: {name} must be positive")
    return prof


# a measured profile's rates: averaged by average_measured (the rest is the first profile's)
_AVERAGED = ("copy_bytes_per_s", "copy_latency_s", "crossing_s", "non_expert_s_per_byte",
             "non_expert_s_per_byte_token", "draft_s_per_byte", "kv_s_per_byte", "kv_s_per_byte_token",
             "draft_s_per_token")


def average_measured(profs: list[MeasuredProfile]) -> MeasuredProfile:
    """The mean of several measurements of one machine (the same model, device and threads): each
    rate, and each expert table point by point. A host whose speed drifts during a long run is
    better held by its profiles measured before and after the run than by either alone."""
    first = profs[0]
    if any(p.device != first.device or p.host_threads != first.host_threads for p in profs):
        raise ValueError("average_measured: profiles of different devices or thread counts")

    def tables(side: str) -> dict:
        out = {}
        for q, (n, x) in getattr(first, side).items():
            rows = [getattr(p, side).get(q) for p in profs]
            if any(r is None or tuple(r[0]) != tuple(n) for r in rows):
                raise ValueError(f"average_measured: [{side}.{q}] measured at other token counts")
            out[q] = (tuple(n), tuple(sum(r[1][i] for r in rows) / len(rows) for i in range(len(n))))
        return out

    means = {f: sum(getattr(p, f) for p in profs) / len(profs) for f in _AVERAGED}
    staged = [p for p in profs if p.stage_bytes_per_s]  # 0: the staging path was not measured, not a rate of 0
    for f in ("stage_bytes_per_s", "stage_batch_s"):
        means[f] = sum(getattr(p, f) for p in staged) / len(staged) if staged else 0.0
    return replace(first, host=tables("host"), device_rates=tables("device_rates"), **means,
                   measured_at=" and ".join(p.measured_at for p in profs))


def write_measured(path: str | Path, prof: MeasuredProfile, comment: str = "") -> Path:
    """Write `prof` as TOML (the format `read_measured` loads)."""
    def num(x) -> str:
        return repr(float(x))

    def text(x) -> str:
        return '"' + str(x).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"# {line}" for line in comment.splitlines()] + [
        "[profile]", f"format = {text(MEASURED_FORMAT)}", f"version = {MEASURED_VERSION}", f"name = {text(prof.name)}",
        f"cpu = {text(prof.cpu)}", f"device = {text(prof.device)}", f"host_threads = {prof.host_threads}",
        f"vram_GB = {num(prof.vram_GB)}", f"zero_slot = {'true' if prof.zero_slot else 'false'}",
        f"overlap = {'true' if prof.overlap else 'false'}", f"non_expert_on = {text(prof.non_expert_on)}",
        f"copy_blocks_device = {'true' if prof.copy_blocks_device else 'false'}",
        f"measured_with = {text(prof.measured_with)}", f"measured_at = {text(prof.measured_at)}", ""]
    for side, rates in (("host", prof.host), ("device", prof.device_rates)):
        for q, (n, x) in rates.items():
            lines += [f"[{side}.{q}]   # one expert's matmuls with this many tokens: bytes × s_per_byte (linear between)",
                      f"tokens = [{', '.join(str(int(v)) for v in n)}]",
                      f"s_per_byte = [{', '.join(num(v) for v in x)}]", ""]
    lines += ["[copy]   # one expert host → device: latency_s + bytes / bytes_per_s",
              f"bytes_per_s = {num(prof.copy_bytes_per_s)}", f"latency_s = {num(prof.copy_latency_s)}", "",
              *(["[stage]   # experts copied inside a pass (uploads on miss, the miss gate's): per layer that copies,",
                 "          # batch_s + its bytes / bytes_per_s",
                 f"bytes_per_s = {num(prof.stage_bytes_per_s)}", f"batch_s = {num(prof.stage_batch_s)}", ""]
                if prof.stage_bytes_per_s or prof.stage_batch_s else []),
              "[crossing]   # per split MoE layer and pass: hidden state to the host and the host half's output back",
              f"s = {num(prof.crossing_s)}", "",
              "[non_expert]   # a pass outside the routed experts (profile.non_expert_on): non-expert bytes × (a + tokens × b)",
              "               # + KV bytes of the context × (s_per_kv_byte + tokens × s_per_kv_byte_token)",
              f"s_per_byte = {num(prof.non_expert_s_per_byte)}",
              f"s_per_byte_token = {num(prof.non_expert_s_per_byte_token)}",
              f"s_per_kv_byte = {num(prof.kv_s_per_byte)}",
              f"s_per_kv_byte_token = {num(prof.kv_s_per_byte_token)}", "",
              "[draft]   # one draft token on the host: s_per_token for this file, else its bytes × s_per_byte",
              f"file = {text(prof.draft_file)}", f"s_per_token = {num(prof.draft_s_per_token)}",
              f"s_per_byte = {num(prof.draft_s_per_byte)}", ""]
    if prof.disk is not None:
        lines += ["[disk]   # below the host RAM: sequential read rate, one 4 KiB read, reads in flight the rate needs",
                  f"read_bytes_per_s = {num(prof.disk.read_bytes_per_s)}", f"latency_s = {num(prof.disk.latency_s)}",
                  f"queue_depth = {int(prof.disk.queue_depth)}", ""]
    if prof.check:
        lines += ["[check]   # a split pass at measurement: predicted from the rates above vs timed"]
        lines += [f"{k} = {num(v)}" for k, v in prof.check.items()] + [""]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def is_measured(hardware_key: str) -> bool:
    """A --hardware value naming a measured profile file rather than a datasheet profile."""
    return hardware_key.endswith(".toml")


def from_gguf(path, draft: bool = False) -> tuple[ModelProfile, str]:
    """(profile, weight format of its experts) read from a GGUF file's metadata and tensor
    list, for simulating a model that has no hand-written profile (e.g. a recorded trace of
    one's own model). Parameter counts come from the tensors themselves: per MoE block the
    `ffn_*_exps` tensors divided by the expert count, and everything else of the block.
    draft=True: the profile of a draft model, whose per-token cost is its whole block plus the
    top_k experts each token reads (a dense draft has none). A hybrid's KV cache and recurrent
    state are counted as the placement counts them (`model_sizes`)."""
    from pathlib import Path

    import gguf


    reader = gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    n_block, n_expert = int(field(f"{arch}.block_count")), int(field(f"{arch}.expert_count", 0))
    d_model = int(field(f"{arch}.embedding_length"))
    head_dim = int(field(f"{arch}.attention.key_length", d_model // int(field(f"{arch}.attention.head_count", 1))))
    kv_heads = field(f"{arch}.attention.head_count_kv", field(f"{arch}.attention.head_count", 1))
    kv_heads = int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads)
    kv = n_block * 2 * kv_heads * head_dim * 2
    hybrid = dict(recurrent_blocks=sum(recurrent_layers(field, arch, n_block)))
    if hybrid["recurrent_blocks"]:
        sizes = model_sizes(path)
        kv, hybrid["state_bytes"] = sizes.kv_bytes_per_token, sizes.state_bytes
    experts, rest, moe, head, expert_type = {}, {}, set(), 0, None
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            block = int(parts[1])
            if "_exps" in parts[2] and n_expert:
                experts[block] = experts.get(block, 0) + int(t.n_elements)
                moe.add(block)
                expert_type = expert_type or t.tensor_type.name
            else:
                rest[block] = rest.get(block, 0) + int(t.n_elements)
        elif t.name == "output.weight":
            head = int(t.n_elements)
    tied = head == 0
    if tied:
        head = next(int(t.n_elements) for t in reader.tensors if t.name == "token_embd.weight")
    if not moe:
        if not draft:
            raise ValueError(f"{path}: no MoE blocks (no ffn_*_exps tensors)")
        return ModelProfile(key=f"gguf-draft:{Path(path).stem}", name=Path(path).stem, source=str(path), draft=True,
                            n_block=n_block, d_model=d_model, block_params=max(rest.values()), head_params=head,
                            kv_bytes_per_token=kv, tie_embeddings=tied, **hybrid), "F16"
    first, last = min(moe), max(moe)
    dense = [rest[b] for b in rest if b not in moe]
    profile = ModelProfile(
        key=f"gguf:{Path(path).stem}", name=Path(path).stem, source=str(path), n_block=n_block, d_model=d_model,
        block_params=max(rest[b] for b in moe), head_params=head, kv_bytes_per_token=kv,
        moe_blocks=(first, last), n_expert=n_expert, top_k=int(field(f"{arch}.expert_used_count")),
        expert_params=experts[first] // n_expert, dense_block_params=max(dense) if dense else 0, tie_embeddings=tied,
        **hybrid)
    quant = expert_type if expert_type in BITS_PER_WEIGHT else "F16"
    if draft:
        from dataclasses import replace

        profile = replace(profile, key=f"gguf-draft:{Path(path).stem}", draft=True,
                          block_params=profile.block_params + profile.top_k * profile.expert_params)
    return profile, quant


def register(profile: ModelProfile) -> str:
    """Make a profile built at run time (e.g. `from_gguf`) known to `model` by its key."""
    model_profiles()[profile.key] = profile
    return profile.key
