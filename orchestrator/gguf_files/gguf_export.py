"""Write GGUF models for llama.cpp: Qwen3-MoE, Qwen3 (dense), Qwen2-MoE (shared expert), OLMoE,
Qwen3.5/3.6-MoE (qwen35moe: a hybrid of gated-delta-net linear attention and full attention).

A model is a `ModelConfig`, a `Tokenizer` and a dict of numpy arrays named as in GGUF
(`blk.0.ffn_gate_exps.weight`, ...). Array shapes follow PyTorch (out, in): ggml's shapes
reversed, so an expert tensor is (n_expert, n_ff_exp, n_embd). Keys and tensor names come
from `gguf`'s constants, never re-typed.

    cfg = tiny_config("qwen2moe", n_layer=2)
    make_random_model("tiny.gguf", cfg, seed=0)          # random weights, F32
    quantize_gguf("tiny.gguf", "tiny-q4_0.gguf", "q4_0") # through llama.cpp (llama-cpp-python)

Every file is written to a temporary name beside its destination and renamed when complete,
so a failure never leaves a half-written model behind.

Why ~580 lines: the model config, its tensor shapes and the writer must agree tensor by tensor
for every architecture the project makes files of (dense, MoE with and without shared experts,
MLA, the hybrids' delta-net layers and MTP head); the tokenizer (tokenizer.py), the real-shaped
presets (synthetic_models.py) and the draft slicer (hot_experts.py) are separate.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, GGMLQuantizationType

from orchestrator.gguf_files.tokenizer import Tokenizer, byte_level_bpe_tokenizer

__all__ = [
    "ARCHES",
    "ModelConfig",
    "Tokenizer",
    "tiny_config",
    "tensor_shapes",
    "validate_tensors",
    "random_weights",
    "byte_level_bpe_tokenizer",
    "write_gguf",
    "make_random_model",
    "quantize_gguf",
    "QUANT_TYPES",
    "WRITE_DTYPES",
    "read_config",
    "atomic_path",
]

ARCHES: dict[str, MODEL_ARCH] = {
    gguf.MODEL_ARCH_NAMES[a]: a
    for a in (MODEL_ARCH.QWEN3MOE, MODEL_ARCH.QWEN3, MODEL_ARCH.QWEN2MOE, MODEL_ARCH.OLMOE, MODEL_ARCH.QWEN35MOE)
}
MOE_ARCHES = {gguf.MODEL_ARCH_NAMES[a] for a in (MODEL_ARCH.QWEN3MOE, MODEL_ARCH.QWEN2MOE, MODEL_ARCH.OLMOE,
                                                  MODEL_ARCH.QWEN35MOE)}
# Qwen3.5/3.6's mrope_section (config.json), which llama.cpp's qwen35moe requires; a text-only
# prompt has the same position in every section
QWEN35_ROPE_SECTIONS = (11, 11, 10, 0)

# Types `write_gguf` produces itself (numpy); anything else goes through `quantize_gguf`.
WRITE_DTYPES: dict[str, GGMLQuantizationType] = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
# Types `quantize_gguf` accepts: llama.cpp's file types by their usual lower-case names.
QUANT_TYPES: dict[str, gguf.LlamaFileType] = {
    name.removeprefix("MOSTLY_").removeprefix("ALL_").lower(): ft
    for name, ft in gguf.LlamaFileType.__members__.items()
    if name not in ("GUESSED",)
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of one model. `arch` is a GGUF architecture name (see ARCHES)."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int = 0  # dense FFN width (qwen3); informative only for MoE arches
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # qwen2moe shared expert width
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False  # no output.weight; llama.cpp reuses token_embd (qwen3*)
    qkv_bias: bool = False  # qwen2moe: Q/K/V projections carry biases
    name: str = "spac-model"
    # qwen35moe: every full_attention_interval-th layer is full attention (a gated query: q and its
    # gate from one projection, rope on rope_dim of head_dim), the others gated delta nets with
    # linear_k_heads key and linear_v_heads value heads of linear_head_dim and a conv of conv_kernel
    full_attention_interval: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 0
    rope_dim: int = 0  # 0: head_dim
    # qwen35moe: multi-token-prediction layers after the trunk (`<arch>.nextn_predict_layers`; block
    # count n_layer + n_mtp), each a full-attention MoE block with the nextn projection and norms
    n_mtp: int = 0

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "qwen35moe"

    def is_recurrent(self, layer: int) -> bool:
        """A linear-attention layer of a hybrid (llama.cpp's hparams.is_recr)."""
        return self.is_hybrid and (layer + 1) % self.full_attention_interval != 0

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHES

    def check(self) -> None:
        """Raise ValueError if the architecture and dimensions do not fit together."""
        if self.arch not in ARCHES:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {sorted(ARCHES)}")
        for f in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{self.arch}: {f} must be > 0, got {getattr(self, f)}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.is_moe:
            if self.n_expert <= 0 or self.n_ff_exp <= 0:
                raise ValueError(f"{self.arch} needs n_expert > 0 and n_ff_exp > 0")
            if not 0 < self.n_expert_used <= self.n_expert:
                raise ValueError(f"n_expert_used {self.n_expert_used} must be in 1..n_expert ({self.n_expert})")
        elif self.n_ff <= 0:
            raise ValueError(f"{self.arch} is dense and needs n_ff > 0")
        elif self.n_expert:
            raise ValueError(f"{self.arch} is dense but n_expert = {self.n_expert}")
        if self.is_hybrid:
            for f in ("full_attention_interval", "linear_k_heads", "linear_v_heads", "linear_head_dim", "conv_kernel",
                      "n_ff_shexp"):
                if getattr(self, f) <= 0:
                    raise ValueError(f"{self.arch}: {f} must be > 0, got {getattr(self, f)}")
            if self.linear_v_heads % self.linear_k_heads:
                raise ValueError(f"linear_v_heads {self.linear_v_heads} is not a multiple of linear_k_heads "
                                 f"{self.linear_k_heads}")
        elif self.full_attention_interval or self.linear_k_heads or self.linear_v_heads or self.conv_kernel:
            raise ValueError(f"{self.arch} has no linear-attention layers")
        if self.n_mtp and (not self.is_hybrid or self.n_mtp != 1):
            raise ValueError(f"n_mtp {self.n_mtp}: the writer makes one MTP layer, on qwen35moe only "
                             "(llama.cpp's qwen35moe MTP graph runs a single block)")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and at most head_dim {self.head_dim}")
        if self.arch == "qwen2moe":
            if self.n_ff_shexp <= 0:
                raise ValueError("qwen2moe needs n_ff_shexp > 0 (shared expert)")
            if self.n_head * self.head_dim != self.n_embd:
                raise ValueError("qwen2moe needs n_head * head_dim == n_embd")
            if self.tie_embeddings:
                raise ValueError("qwen2moe requires output.weight (tie_embeddings=False)")
        elif (self.n_ff_shexp and not self.is_hybrid) or self.qkv_bias:
            raise ValueError(f"{self.arch} has no shared expert or Q/K/V bias")
        if self.arch == "olmoe":
            if self.n_head * self.head_dim != self.n_embd or self.n_head_kv != self.n_head:
                raise ValueError("olmoe needs n_head * head_dim == n_embd and n_head_kv == n_head")
            if self.n_ff != self.n_ff_exp or self.tie_embeddings:
                raise ValueError("olmoe reads the expert width from n_ff (set n_ff == n_ff_exp) and needs output.weight")

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


def tiny_config(arch: str = "qwen3moe", **overrides) -> ModelConfig:
    """A tiny model of `arch` for tests: 2 layers, d 64, 8 experts top-2 (MoE) or ff 128."""
    base = dict(arch=arch, n_vocab=320, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16,
                n_ctx_train=512, name=f"spac-random-{arch}")
    if arch in MOE_ARCHES:
        base.update(n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff=64)
    else:
        base.update(n_ff=128)
    if arch == "qwen2moe":
        base.update(n_ff_shexp=64, qkv_bias=True)
    if arch == "olmoe":
        base.update(n_head_kv=4, n_ff=32)
    if arch == "qwen35moe":  # 4 layers: three linear-attention layers, then one full-attention layer
        # head_dim 32: its rope sections (11 + 11 + 10 pairs) must fit in a head
        base.update(n_layer=4, head_dim=32, n_ff_shexp=32, full_attention_interval=4, linear_k_heads=2,
                    linear_v_heads=4, linear_head_dim=16, conv_kernel=4, rope_dim=8)
    base.update(overrides)
    cfg = ModelConfig(**base)
    cfg.check()
    return cfg


def _tn(t: MODEL_TENSOR, suffix: str = "weight", bid: int | None = None) -> str:
    name = gguf.TENSOR_NAMES[t] if bid is None else gguf.TENSOR_NAMES[t].format(bid=bid)
    return f"{name}.{suffix}" if suffix else name


def _linear_attention(cfg: ModelConfig, L) -> dict[str, tuple[int, ...]]:
    """A gated delta net's tensors (llama.cpp's qwen35moe load_arch_tensors): q, k, v from one
    projection through a causal conv, an output gate, per-value-head decay (ssm_a, ssm_dt) and
    mixing rates (ssm_alpha, ssm_beta), a norm of head size and the output projection."""
    d, hd = cfg.n_embd, cfg.linear_head_dim
    key, value = cfg.linear_k_heads * hd, cfg.linear_v_heads * hd
    return {L(MODEL_TENSOR.SSM_A, ""): (cfg.linear_v_heads,),
            L(MODEL_TENSOR.SSM_CONV1D): (2 * key + value, cfg.conv_kernel),
            L(MODEL_TENSOR.SSM_DT, "bias"): (cfg.linear_v_heads,),
            L(MODEL_TENSOR.SSM_ALPHA): (cfg.linear_v_heads, d),
            L(MODEL_TENSOR.SSM_BETA): (cfg.linear_v_heads, d),
            L(MODEL_TENSOR.ATTN_QKV): (2 * key + value, d),
            L(MODEL_TENSOR.ATTN_GATE): (value, d),
            L(MODEL_TENSOR.SSM_NORM): (hd,),
            L(MODEL_TENSOR.SSM_OUT): (d, value)}


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model has, in file order, with its numpy (PyTorch-order) shape."""
    cfg.check()
    d, v = cfg.n_embd, cfg.n_vocab
    shapes: dict[str, tuple[int, ...]] = {_tn(MODEL_TENSOR.TOKEN_EMBD): (v, d)}
    for i in range(cfg.n_layer + cfg.n_mtp):
        L = lambda t, s="weight": _tn(t, s, i)  # noqa: E731
        shapes[L(MODEL_TENSOR.ATTN_NORM)] = (d,)
        if i < cfg.n_layer and cfg.is_recurrent(i):
            shapes.update(_linear_attention(cfg, L))
        else:  # an MTP layer is full attention (llama.cpp's qwen35moe load_block_mtp)
            _attention(cfg, L, shapes)
        if cfg.is_hybrid:  # the post-attention norm stands where ffn_norm does
            shapes[L(MODEL_TENSOR.ATTN_POST_NORM)] = (d,)
        else:
            shapes[L(MODEL_TENSOR.FFN_NORM)] = (d,)
        if i >= cfg.n_layer:  # the MTP head: [enorm(embedding), hnorm(hidden)] projected back to d
            shapes[L(MODEL_TENSOR.NEXTN_EH_PROJ)] = (d, 2 * d)
            for t in (MODEL_TENSOR.NEXTN_ENORM, MODEL_TENSOR.NEXTN_HNORM, MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM):
                shapes[L(t)] = (d,)
        if cfg.is_moe:
            e, f = cfg.n_expert, cfg.n_ff_exp
            shapes[L(MODEL_TENSOR.FFN_GATE_INP)] = (e, d)
            shapes[L(MODEL_TENSOR.FFN_GATE_EXP)] = (e, f, d)
            shapes[L(MODEL_TENSOR.FFN_UP_EXP)] = (e, f, d)
            shapes[L(MODEL_TENSOR.FFN_DOWN_EXP)] = (e, d, f)
            if cfg.n_ff_shexp:
                s = cfg.n_ff_shexp
                shapes[L(MODEL_TENSOR.FFN_GATE_INP_SHEXP)] = (1, d) if cfg.is_hybrid else (d,)
                shapes[L(MODEL_TENSOR.FFN_GATE_SHEXP)] = (s, d)
                shapes[L(MODEL_TENSOR.FFN_UP_SHEXP)] = (s, d)
                shapes[L(MODEL_TENSOR.FFN_DOWN_SHEXP)] = (d, s)
        else:
            shapes[L(MODEL_TENSOR.FFN_GATE)] = (cfg.n_ff, d)
            shapes[L(MODEL_TENSOR.FFN_UP)] = (cfg.n_ff, d)
            shapes[L(MODEL_TENSOR.FFN_DOWN)] = (d, cfg.n_ff)
    shapes[_tn(MODEL_TENSOR.OUTPUT_NORM)] = (d,)
    if not cfg.tie_embeddings:
        shapes[_tn(MODEL_TENSOR.OUTPUT)] = (v, d)
    return shapes


def _attention(cfg: ModelConfig, L, shapes: dict) -> None:
    """A layer's (full) attention tensors; qwen35moe's query projection also gives its output gate."""
    d, hd = cfg.n_embd, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    shapes[L(MODEL_TENSOR.ATTN_Q)] = (2 * q if cfg.is_hybrid else q, d)
    shapes[L(MODEL_TENSOR.ATTN_K)] = (kv, d)
    shapes[L(MODEL_TENSOR.ATTN_V)] = (kv, d)
    if cfg.qkv_bias:
        shapes[L(MODEL_TENSOR.ATTN_Q, "bias")] = (q,)
        shapes[L(MODEL_TENSOR.ATTN_K, "bias")] = (kv,)
        shapes[L(MODEL_TENSOR.ATTN_V, "bias")] = (kv,)
    if cfg.arch == "olmoe":  # q/k norm over the whole projection
        shapes[L(MODEL_TENSOR.ATTN_Q_NORM)] = (q,)
        shapes[L(MODEL_TENSOR.ATTN_K_NORM)] = (kv,)
    elif cfg.arch != "qwen2moe":
        shapes[L(MODEL_TENSOR.ATTN_Q_NORM)] = (hd,)
        shapes[L(MODEL_TENSOR.ATTN_K_NORM)] = (hd,)
    shapes[L(MODEL_TENSOR.ATTN_OUT)] = (d, q)


TensorSource = Mapping[str, "np.ndarray | Callable[[], np.ndarray]"]


def validate_tensors(cfg: ModelConfig, tensors: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    """Check names and shapes against `cfg`; raise one ValueError listing every problem.

    Values may be arrays or zero-argument callables (lazy tensors, not called here)."""
    shapes = tensor_shapes(cfg)
    problems = [f"missing tensor {n} {s}" for n, s in shapes.items() if n not in tensors]
    problems += [f"unexpected tensor {n}" for n in tensors if n not in shapes]
    for n, t in tensors.items():
        if n in shapes and not callable(t) and tuple(np.shape(t)) != shapes[n]:
            problems.append(f"{n}: shape {tuple(np.shape(t))}, expected {shapes[n]} for this config")
    if problems:
        head = f"tensors do not match {cfg.arch} config (n_embd={cfg.n_embd}, n_layer={cfg.n_layer})"
        raise ValueError(head + ":\n  " + "\n  ".join(problems[:20])
                         + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""))
    return shapes


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random float32 weights: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1²).

    Routers are drawn like any matrix, so routing varies from token to token."""
    rng = np.random.default_rng(seed)
    return {name: _random_tensor(rng, name, shape) for name, shape in tensor_shapes(cfg).items()}


def _random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith(SSM_A):
        return ssm_a(rng, shape)
    if len(shape) == 1:
        base = 0.0 if name.endswith(".bias") or "shexp" in name else 1.0
        return (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    scale = 1.0 if name.startswith(gguf.TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]) else shape[-1] ** -0.5
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


SSM_A = ".ssm_a"


def ssm_a(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A gated delta net's per-head decay rate as llama.cpp reads it, -exp(A_log) with A drawn
    from 1..16 (Qwen3.5's initialisation): negative, so the state decays instead of growing."""
    return -rng.uniform(1.0, 16.0, shape).astype(np.float32)


# --- writing ----------------------------------------------------------------------------------

@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, tok: Tokenizer, dtype: str) -> None:
    w.add_name(cfg.name)
    w.add_file_type(_FILE_TYPE[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(cfg.n_vocab)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer + cfg.n_mtp)
    if cfg.n_mtp:
        w.add_nextn_predict_layers(cfg.n_mtp)
    w.add_feed_forward_length(cfg.n_ff if cfg.n_ff else cfg.n_ff_exp * cfg.n_expert_used)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rope_dim or cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.is_hybrid:  # llama.cpp's hparams: ssm_d_state = head dim, n_group = key heads, dt_rank = value heads
        w.add_ssm_conv_kernel(cfg.conv_kernel)
        w.add_ssm_state_size(cfg.linear_head_dim)
        w.add_ssm_group_count(cfg.linear_k_heads)
        w.add_ssm_time_step_rank(cfg.linear_v_heads)
        w.add_ssm_inner_size(cfg.linear_v_heads * cfg.linear_head_dim)
        w.add_full_attention_interval(cfg.full_attention_interval)
        w.add_rope_dimension_sections(list(QWEN35_ROPE_SECTIONS))
    if cfg.is_moe:
        w.add_expert_count(cfg.n_expert)
        w.add_expert_used_count(cfg.n_expert_used)
        w.add_expert_feed_forward_length(cfg.n_ff_exp)
        if cfg.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_eos_token_id(tok.eos_id)
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    if tok.pad_id is not None:
        w.add_pad_token_id(tok.pad_id)
    w.add_add_bos_token(tok.add_bos)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    """1-D tensors (norms, biases, gates), a delta net's conv kernel and a one-row shared-expert
    gate stay F32, as llama.cpp's converter and quantizer keep them."""
    return len(shape) == 1 or shape[0] == 1 or ".ssm_conv1d." in name


def _storage_type(name: str, shape: tuple[int, ...], dtype: str) -> GGMLQuantizationType:
    """keeps_f32 tensors stay F32; block quants need rows divisible by the block."""
    qtype = WRITE_DTYPES[dtype]
    if keeps_f32(name, shape):
        return GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        return GGMLQuantizationType.F16
    return qtype


def write_gguf(path: str | os.PathLike[str], cfg: ModelConfig, tensors: TensorSource, tokenizer: Tokenizer,
               dtype: str = "f32", metadata: Mapping[str, str] | None = None,
               progress: Callable[[str], None] | None = None) -> Path:
    """Write a complete GGUF for `cfg` and return its path.

    tensors: name -> float array (PyTorch-order shape), or name -> zero-argument callable
             returning it, called once while writing (so a huge model is never held in RAM).
             A uint8 array is taken as data already in the tensor's storage type (raw blocks).
    dtype:   one of WRITE_DTYPES; 1-D tensors are always F32. Other types: `quantize_gguf`.
    metadata: extra string key/values (e.g. {"spac.training_command": ...}).
    """
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} for write_gguf; expected one of {sorted(WRITE_DTYPES)} "
                         "(other types: quantize_gguf)")
    cfg.check()
    if len(tokenizer) != cfg.n_vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but n_vocab = {cfg.n_vocab}")
    shapes = validate_tensors(cfg, tensors)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, cfg.arch)
        _write_metadata(w, cfg, tokenizer, dtype)
        for k, v in (metadata or {}).items():
            w.add_string(k, v)
        qtypes = {n: _storage_type(n, s, dtype) for n, s in shapes.items()}
        for name, shape in shapes.items():
            q = qtypes[name]
            nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, q)))
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape in shapes.items():
            src = tensors[name]
            arr = np.asarray(src() if callable(src) else src)
            if arr.dtype == np.uint8:  # already in the storage type's blocks (e.g. synthetic Q4_0)
                want = gguf.quant_shape_to_byte_shape(shape, qtypes[name])
                if arr.shape != want:
                    raise ValueError(f"{name}: raw {qtypes[name].name} data has shape {arr.shape}, expected {want}")
                w.write_tensor_data(arr)
            else:
                arr = arr.astype(np.float32, copy=False)
                if arr.shape != shape:
                    raise ValueError(f"{name}: lazy tensor has shape {arr.shape}, expected {shape}")
                if not np.all(np.isfinite(arr)):
                    raise ValueError(f"{name}: contains NaN or Inf")
                w.write_tensor_data(gguf.quants.quantize(arr, qtypes[name]))
            if progress:
                progress(name)
        w.close()
    return Path(path)


def make_random_model(path: str | os.PathLike[str], cfg: ModelConfig | str = "qwen3moe", seed: int = 0,
                      dtype: str = "f32", quant: str | None = None) -> Path:
    """Write a seeded random-weight model with a byte-level BPE tokenizer of cfg.n_vocab tokens.

    cfg: a ModelConfig or an arch name (then `tiny_config(arch)`). dtype: how `write_gguf`
    stores it; quant: if given, the file is then re-quantized through llama.cpp to this type."""
    if isinstance(cfg, str):
        cfg = tiny_config(cfg)
    tok = byte_level_bpe_tokenizer(cfg.n_vocab)
    meta = {"spac.random_seed": str(seed)}
    if quant is None:
        return write_gguf(path, cfg, random_weights(cfg, seed), tok, dtype=dtype, metadata=meta)
    _quant_ftype(quant)  # fail before writing anything
    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent if path.parent.exists() else None) as d:
        src = write_gguf(Path(d) / "src.gguf", cfg, random_weights(cfg, seed), tok, dtype=dtype, metadata=meta)
        return quantize_gguf(src, path, quant)


def _quant_ftype(quant: str) -> gguf.LlamaFileType:
    ft = QUANT_TYPES.get(quant.lower())
    if ft is None:
        raise ValueError(f"unknown quant type {quant!r}; expected one of {sorted(QUANT_TYPES)}")
    return ft


def quantize_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str,
                  n_threads: int = 0) -> Path:
    """Re-quantize a GGUF with llama.cpp's quantizer (llama-cpp-python), e.g. "q4_0", "q8_0",
    "q4_k_m". Tensors whose rows do not fit the block size get llama.cpp's fallback type."""
    ft = _quant_ftype(quant)
    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(src)
    with atomic_path(dst) as tmp:
        _llama_quantize(src, tmp, int(ft), n_threads, what=f"{src.name} -> {quant}")
    return Path(dst)


def _llama_quantize(src: Path, dst: Path, ftype: int, n_threads: int = 0, what: str = "") -> None:
    """llama.cpp's quantizer: write src re-quantized to file type `ftype` (a llama_ftype) to dst."""
    # imported here: llama-cpp-python (built from the pinned sdist) is needed by this function only,
    # and the rest of the module (writing GGUFs) runs without it
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({what or Path(src).name}) failed with code {rc}")


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a GGUF written by this module (or any qwen3/qwen3moe/qwen2moe GGUF)."""
    r = gguf.GGUFReader(path)

    def get(key: str, default=None):
        f = r.get_field(key)
        return default if f is None else f.contents()

    arch = get(gguf.Keys.General.ARCHITECTURE)
    k = lambda key: key.format(arch=arch)  # noqa: E731
    n_head = int(get(k(gguf.Keys.Attention.HEAD_COUNT)))
    n_embd = int(get(k(gguf.Keys.LLM.EMBEDDING_LENGTH)))
    names = {t.name for t in r.tensors}
    n_mtp = int(get(k(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS), 0))
    return ModelConfig(
        arch=arch,
        n_vocab=len(get(gguf.Keys.Tokenizer.LIST)),
        n_embd=n_embd,
        n_layer=int(get(k(gguf.Keys.LLM.BLOCK_COUNT))) - n_mtp,
        n_head=n_head,
        n_head_kv=int(get(k(gguf.Keys.Attention.HEAD_COUNT_KV), n_head)),
        head_dim=int(get(k(gguf.Keys.Attention.KEY_LENGTH), n_embd // n_head)),
        n_ff=int(get(k(gguf.Keys.LLM.FEED_FORWARD_LENGTH), 0)),
        n_expert=int(get(k(gguf.Keys.LLM.EXPERT_COUNT), 0)),
        n_expert_used=int(get(k(gguf.Keys.LLM.EXPERT_USED_COUNT), 0)),
        n_ff_exp=int(get(k(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), 0)),
        n_ff_shexp=int(get(k(gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), 0)),
        n_ctx_train=int(get(k(gguf.Keys.LLM.CONTEXT_LENGTH))),
        rope_freq_base=float(f"{get(k(gguf.Keys.Rope.FREQ_BASE), 10000.0):.7g}"),
        rms_norm_eps=float(f"{get(k(gguf.Keys.Attention.LAYERNORM_RMS_EPS)):.7g}"),  # stored as f32
        tie_embeddings=_tn(MODEL_TENSOR.OUTPUT) not in names,
        qkv_bias=_tn(MODEL_TENSOR.ATTN_Q, "bias", 0) in names,
        name=str(get(gguf.Keys.General.NAME, "")),
        n_mtp=n_mtp,
        **_read_hybrid(get, k, n_embd // n_head),
    )


def _read_hybrid(get, k, head_dim: int) -> dict:
    """The linear-attention fields of a qwen35moe file (none for the other architectures)."""
    if get(k(gguf.Keys.SSM.CONV_KERNEL)) is None:
        return {}
    rope = int(get(k(gguf.Keys.Rope.DIMENSION_COUNT), 0))
    return dict(full_attention_interval=int(get(k(gguf.Keys.LLM.FULL_ATTENTION_INTERVAL), 4)),
                linear_k_heads=int(get(k(gguf.Keys.SSM.GROUP_COUNT))),
                linear_v_heads=int(get(k(gguf.Keys.SSM.TIME_STEP_RANK))),
                linear_head_dim=int(get(k(gguf.Keys.SSM.STATE_SIZE))), conv_kernel=int(get(k(gguf.Keys.SSM.CONV_KERNEL))),
                rope_dim=0 if rope == int(get(k(gguf.Keys.Attention.KEY_LENGTH), head_dim)) else rope)


def with_overrides(cfg: ModelConfig, **kw) -> ModelConfig:
    out = replace(cfg, **kw)
    out.check()
    return out
