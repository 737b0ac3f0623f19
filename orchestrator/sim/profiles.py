"""Hardware and model profiles (data in `orchestrator/profiles/*.toml`) and the cost model.

The cost model turns a (hardware, target model, draft model, quantisation) choice into the
unit times the simulator charges. All of it is roofline arithmetic on the profile numbers:

    device expert, n tokens    max(W_e / B_gpu, n·F_e / P_gpu)     W_e expert bytes, F_e = 2·params
    host expert, n tokens      max(W_e / B_cpu, n·F_e / P_cpu)     weights streamed once per pass
    copy one expert            W_e / B_pcie
    dense part of a block      W_block / B_gpu + layer overhead    (attention, router, shared experts)
    output head                W_head / B_gpu
    one draft token            W_draft / B_gpu + n_block_draft · layer overhead

with every B and P the profile's peak times its efficiency.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

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

    @property
    def gpu_bw(self) -> float:
        return self.gpu_mem_GBps * self.gpu_efficiency * 1e9

    @property
    def pcie_bw(self) -> float:
        return self.pcie_GBps * self.pcie_efficiency * 1e9

    @property
    def cpu_bw(self) -> float:
        return self.cpu_mem_GBps * self.cpu_efficiency * 1e9


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


def _load(name: str) -> dict:
    with open(PROFILE_DIR / name, "rb") as f:
        return tomllib.load(f)


@lru_cache(maxsize=None)
def hardware_profiles() -> dict[str, HardwareProfile]:
    return {k: HardwareProfile(key=k, **v) for k, v in _load("hardware.toml").items()}


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
    vram_bytes: float = float("inf")
    static_bytes: float = 0.0  # device memory that is not the expert pool (weights, draft, KV)

    @classmethod
    def build(
        cls,
        hw: HardwareProfile,
        target: ModelProfile,
        draft: ModelProfile | None = None,
        quant: str = "Q4_K",
        draft_quant: str = "Q8_0",
        context: int = 4096,
    ) -> CostModel:
        bpw = BITS_PER_WEIGHT[quant] / 8
        overhead = hw.layer_overhead_us * 1e-6
        dense_layer = target.block_params * bpw / hw.gpu_bw + overhead
        dense_blocks = target.n_dense_block * ((target.dense_block_params or target.block_params) * bpw / hw.gpu_bw + overhead)
        head = target.head_params * bpw / hw.gpu_bw
        static = target.non_expert_bytes(quant) + context * target.kv_bytes_per_token
        draft_s = 0.0
        if draft is not None:
            draft_bytes = (draft.n_block * draft.block_params + draft.head_params) * BITS_PER_WEIGHT[draft_quant] / 8
            draft_s = draft_bytes / hw.gpu_bw + draft.n_block * overhead
            static += draft_bytes + context * draft.kv_bytes_per_token
        return cls(
            expert_bytes=target.expert_bytes(quant), expert_flops=2.0 * target.expert_params,
            gpu_bw=hw.gpu_bw, gpu_flops=hw.gpu_tflops * 1e12, cpu_bw=hw.cpu_bw, cpu_flops=hw.cpu_gflops * 1e9,
            pcie_bw=hw.pcie_bw, dense_layer_s=dense_layer, fixed_pass_s=dense_blocks + head,
            draft_token_s=draft_s, sync_s=hw.sync_us * 1e-6,
            vram_bytes=hw.vram_GB * 1e9, static_bytes=static,
        )

    @property
    def transfer_s(self) -> float:
        return self.expert_bytes / self.pcie_bw

    def gpu_expert_s(self, n_tokens):
        """Device time of experts with n_tokens tokens each (array or scalar)."""
        return _roofline(self.expert_bytes / self.gpu_bw, self.expert_flops / self.gpu_flops, n_tokens)

    def cpu_expert_s(self, n_tokens):
        """Host time of experts with n_tokens tokens each (array or scalar)."""
        return _roofline(self.expert_bytes / self.cpu_bw, self.expert_flops / self.cpu_flops, n_tokens)


def _roofline(stream_s: float, flop_s: float, n_tokens):
    import numpy as np

    return np.maximum(stream_s, np.asarray(n_tokens, dtype=np.float64) * flop_s)


def from_gguf(path, draft: bool = False) -> tuple[ModelProfile, str]:
    """(profile, weight format of its experts) read from a GGUF file's metadata and tensor
    list, for simulating a model that has no hand-written profile (e.g. a recorded trace of
    one's own model). Parameter counts come from the tensors themselves: per MoE block the
    `ffn_*_exps` tensors divided by the expert count, and everything else of the block.
    draft=True: the profile of a draft model, whose per-token cost is its whole block plus the
    top_k experts each token reads (a dense draft has none)."""
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
                            kv_bytes_per_token=n_block * 2 * kv_heads * head_dim * 2, tie_embeddings=tied), "F16"
    first, last = min(moe), max(moe)
    dense = [rest[b] for b in rest if b not in moe]
    profile = ModelProfile(
        key=f"gguf:{Path(path).stem}", name=Path(path).stem, source=str(path), n_block=n_block, d_model=d_model,
        block_params=max(rest[b] for b in moe), head_params=head, kv_bytes_per_token=n_block * 2 * kv_heads * head_dim * 2,
        moe_blocks=(first, last), n_expert=n_expert, top_k=int(field(f"{arch}.expert_used_count")),
        expert_params=experts[first] // n_expert, dense_block_params=max(dense) if dense else 0, tie_embeddings=tied)
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
