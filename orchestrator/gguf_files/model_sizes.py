"""A GGUF's sizes as the placement and the simulator count them, read from its header and tensor
table (memory-mapped, no weight read): expert and other bytes, the KV cache per token, a hybrid's
recurrent state, the streamed prefill's staging slots. Imports only gguf, so that the simulator
can size a file without the live side (placement, native)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

_EXPERT_TENSOR = "_exps."  # ffn_{up,gate,down,gate_up}_exps: the routed experts


@dataclass(frozen=True)
class ModelSizes:
    n_layer: int
    expert_bytes: int          # every routed expert of every layer
    non_expert_bytes: int      # attention, router, norms, shared experts, embeddings, output head
    kv_bytes_per_token: int    # F16 K and V over the attention layers (a hybrid's full-attention layers)
    n_experts_total: int = 0   # n_layer_moe * n_expert (for the size of one expert)
    n_ctx_train: int = 0       # the GGUF's context_length
    staging_bytes: int = 0     # streamed prefill's staging slots: two layers of experts per slot group
    state_bytes: int = 0       # one sequence's recurrent state over the recurrent layers (F32; 0: no such layer)
    # a prompt pass's compute and scratch (runtime/ubatch.py)
    n_embd: int = 0
    n_vocab: int = 0
    n_head: int = 0
    n_expert: int = 0
    n_ff_active: int = 0       # a token's expert FFN width: n_expert_used routed experts' plus the shared ones'
    active_params: int = 0     # weights a token multiplies: every matrix but the token embeddings, routed experts at n_used / n_expert
    mtp_layers: int = 0        # multi-token-prediction layers after the trunk (nextn_predict_layers): an MTP head

    @property
    def one_expert(self) -> int:
        return self.expert_bytes // self.n_experts_total if self.n_experts_total else 0



def model_sizes(path: str | Path) -> ModelSizes:
    """Sizes from the GGUF header and tensor table (memory-mapped, no weight is read)."""
    import gguf

    r = gguf.GGUFReader(path)

    def get(key: str, default=0):
        f = r.get_field(key)
        return default if f is None else f.contents()

    arch = get(gguf.Keys.General.ARCHITECTURE, "?")
    k = lambda key: key.format(arch=arch)  # noqa: E731
    n_layer = int(get(k(gguf.Keys.LLM.BLOCK_COUNT), 1))
    n_head = int(get(k(gguf.Keys.Attention.HEAD_COUNT), 1) or 1)
    n_head_kv = get(k(gguf.Keys.Attention.HEAD_COUNT_KV), n_head)
    n_embd = int(get(k(gguf.Keys.LLM.EMBEDDING_LENGTH), 0))
    k_len = int(get(k(gguf.Keys.Attention.KEY_LENGTH), n_embd // n_head))
    v_len = int(get(k(gguf.Keys.Attention.VALUE_LENGTH), k_len))
    n_expert = int(get(k(gguf.Keys.LLM.EXPERT_COUNT), 0))
    recurrent = recurrent_layers(get, arch, n_layer)
    # a hybrid's KV cache: its full-attention layers, not the trailing MTP ones (llama.cpp's filter_attn)
    n_main = n_layer - int(get(k(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS), 0)) if any(recurrent) else n_layer
    heads = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer
    kv = sum(2 * int(h) * (k_len + v_len) for h, r in zip(heads[:n_main], recurrent) if not r)  # F16: 2 bytes
    expert = sum(int(t.n_bytes) for t in r.tensors if _EXPERT_TENSOR in t.name + ".")
    other = sum(int(t.n_bytes) for t in r.tensors) - expert
    layers: dict[str, list] = {}  # MoE block -> its expert tensors
    for t in r.tensors:
        if _EXPERT_TENSOR in t.name + "." and t.name.startswith("blk."):
            layers.setdefault(t.name.split(".")[1], []).append(t)
    # the engine's slot groups: layers whose expert tensors agree in type and shape share slots,
    # and a streamed prefill stages two layers of experts per group besides the pool
    groups = {tuple(sorted((t.name.split(".", 2)[2], t.tensor_type, tuple(t.shape)) for t in ts)):
              sum(int(t.n_bytes) for t in ts) for ts in layers.values()}
    n_used = int(get(k(gguf.Keys.LLM.EXPERT_USED_COUNT), 0))
    n_ff_exp = int(get(k(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), 0))
    n_ff_shared = int(get(k(gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), 0)) * int(get(k(gguf.Keys.LLM.EXPERT_SHARED_COUNT), 0))
    n_vocab = next((int(t.shape[1]) for t in r.tensors if t.name == "token_embd.weight" and len(t.shape) > 1), 0)
    elements = lambda t: prod(int(d) for d in t.shape)  # noqa: E731
    routed = sum(elements(t) for t in r.tensors if _EXPERT_TENSOR in t.name + ".")
    dense = sum(elements(t) for t in r.tensors if _EXPERT_TENSOR not in t.name + "." and len(t.shape) >= 2
                and not t.name.startswith("token_embd"))
    return ModelSizes(n_layer=n_layer, expert_bytes=expert, non_expert_bytes=other, kv_bytes_per_token=kv,
                      n_experts_total=len(layers) * n_expert, n_ctx_train=int(get(k(gguf.Keys.LLM.CONTEXT_LENGTH), 0)),
                      staging_bytes=2 * sum(groups.values()), state_bytes=sum(recurrent) * state_per_layer(get, arch),
                      n_embd=n_embd, n_vocab=n_vocab, n_head=n_head, n_expert=n_expert, n_ff_active=n_used * n_ff_exp + n_ff_shared,
                      active_params=dense + (routed * n_used // n_expert if n_expert else 0),
                      mtp_layers=int(get(k(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS), 0) or 0))


# hybrids whose layers are linear attention but every full_attention_interval-th (llama.cpp's
# default 4), unless the file lists its recurrent layers (src/models/qwen35moe.cpp, qwen3next.cpp)
INTERVAL_HYBRIDS = ("qwen3next", "qwen35", "qwen35moe")


def recurrent_layers(get, arch: str, n_layer: int) -> list[bool]:
    """Which layers hold a recurrent state instead of a KV cache, as llama.cpp's hparams.is_recr:
    `<arch>.attention.recurrent_layers` where the file has it, else every layer but each
    full_attention_interval-th of a hybrid, and not the trailing MTP layers (nextn_predict_layers)."""
    import gguf

    flags = get(f"{arch}.attention.recurrent_layers", None)
    if flags is not None:
        return [bool(f) for f in flags][:n_layer] + [False] * max(0, n_layer - len(flags))
    if arch not in INTERVAL_HYBRIDS:
        return [False] * n_layer
    every = int(get(gguf.Keys.LLM.FULL_ATTENTION_INTERVAL.format(arch=arch), 4) or 4)
    n_main = n_layer - int(get(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 0))
    return [i < n_main and (i + 1) % every != 0 for i in range(n_layer)]


def state_per_layer(get, arch: str) -> int:
    """Bytes of one sequence's recurrent state in one recurrent layer: llama.cpp's hparams
    n_embd_r() (the conv state: ssm_d_conv - 1 columns of the d_inner + 2 · n_group · d_state
    channels) plus n_embd_s() (the delta-net / SSM state: d_state · d_inner), both F32. That is
    llama.cpp's formula for the gated delta nets of qwen35moe and qwen3next (and Mamba-2); RWKV,
    LFM2's short conv and Kimi's KDA layers size theirs otherwise, and are not sized here."""
    import gguf

    ssm = lambda key, default=0: int(get(key.format(arch=arch), default) or 0)  # noqa: E731
    d_conv, d_inner = ssm(gguf.Keys.SSM.CONV_KERNEL), ssm(gguf.Keys.SSM.INNER_SIZE)
    d_state, n_group = ssm(gguf.Keys.SSM.STATE_SIZE), ssm(gguf.Keys.SSM.GROUP_COUNT)
    return 4 * (max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state) + d_state * d_inner)
