"""A memory-bound MoE target with meaningful output: the shipped tiny target, widened with
padding whose output is exactly zero, so that it writes the tiny model's text while every
decode step streams as many bytes as a real MoE's layer stack.

    python scripts/make_memory_bound_target.py runs/mb/olmoe-bytes-f16.gguf            # default preset
    python scripts/make_memory_bound_target.py OUT.gguf --preset small                  # seconds, for tests
    python scripts/make_memory_bound_target.py OUT.gguf --n-layer 16 --n-ff-exp 4096 --n-head 64

The padding (F16 like the source; every original value is copied bit for bit):
- wider experts: n_ff_exp rows in gate/up, the new ones zero, and zero columns in down, so an
  expert computes silu(0)·0 = 0 in the new width;
- more attention heads (n_head and n_head_kv grow together, the GQA ratio stays): the new
  heads' q/k/v rows repeat the trained ones, their columns of attn_output are zero;
- more blocks between the trained ones: each copies the norms, attention and router and
  experts of a trained block, with attn_output and ffn_down_exps all zero, so the residual
  stream passes through unchanged while the block reads its weights, routes the real hidden
  state with a trained router, and computes its experts;
- the expert count and top-k stay: routing is the trained routers' own.

Widths grow in multiples of 64 elements, so every dot product keeps its original elements in the
same SIMD lanes in the same order and only adds exact zeros: the logits are bit-identical to the
source's, and so is the greedy text (tests/test_memory_bound_target.py checks it).

Presets (bytes per decode step at one token, F16):
- olmoe-bytes: 16 blocks, 128 heads, experts of ff 5632: about 0.76 GB per token (OLMoE-1B-7B's
  1.3B active parameters at ~4.6 bits), 4.6 GB on disk; with the RPC device holding half the
  experts, about 7 GB of RAM in all.
- small: 8 blocks, 8 heads, ff 128 (the test's scaled-down version).
Never overwrites an existing file.

Its routing of the real hidden states, as a trace for the simulator (the padded blocks route
with trained routers, so the trace has 16 MoE layers of trained routing):

    spac trace record runs/mb/trace.npz -m runs/mb/olmoe-bytes-f16.gguf
        -md orchestrator/shipped_models/spac-tiny-moe-q4_0.gguf --prompts-file PROMPTS.txt -n 64 -c 512   (one line)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.gguf_files.gguf_export import atomic_path, read_config  # noqa: E402
from orchestrator.gguf_files.hot_experts import _copy_metadata  # noqa: E402
from orchestrator.shipped_models import MODELS_DIR  # noqa: E402

SOURCE = MODELS_DIR / "spac-tiny-moe-f16.gguf"
LANES = 64  # ggml's F16 dot product consumes 64 elements per step (4 accumulators of 16 lanes)

PRESETS = {
    "olmoe-bytes": dict(n_layer=16, n_head=128, n_ff_exp=5632),
    "small": dict(n_layer=8, n_head=8, n_ff_exp=128),
}


@dataclass(frozen=True)
class BlockTensor:
    """A tensor of the widened stack: which trained tensor it comes from, of which kind
    (`attn_q`, `ffn_down_exps`, ...), and whether its block is the trained block itself."""

    src: gguf.ReaderTensor
    kind: str
    own: bool


def real_positions(n_src: int, n_layer: int) -> list[int]:
    """Where the trained blocks sit in the widened stack (spread evenly, the first at 0)."""
    return [i * n_layer // n_src for i in range(n_src)]


def source_block(pos: int, n_src: int, n_layer: int) -> tuple[int, bool]:
    """(the trained block whose weights block `pos` copies, whether it is that block itself)."""
    real = real_positions(n_src, n_layer)
    if pos in real:
        return real.index(pos), True
    return pos % n_src, False


def _grow(a: np.ndarray, axis: int, size: int, fill: str) -> np.ndarray:
    """`a` extended along `axis` to `size`: with zeros, or by repeating its own slices."""
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    if fill == "zero":
        shape = list(a.shape)
        shape[axis] = extra
        pad = np.zeros(shape, a.dtype)
    else:
        pad = np.take(a, np.arange(extra) % a.shape[axis], axis=axis)
    return np.concatenate([a, pad], axis=axis)


def padded_tensor(kind: str, data: np.ndarray, own: bool, n_head: int, n_head_kv: int, head_dim: int,
                  n_ff_exp: int) -> np.ndarray:
    """One block tensor of the widened model from the trained block's (numpy order, F16/F32)."""
    if kind in ("attn_q", "attn_k", "attn_v"):  # [heads·hd, d]: new heads repeat the trained rows
        heads = n_head if kind == "attn_q" else n_head_kv
        return _grow(data, 0, heads * head_dim, "repeat")
    if kind == "attn_output":                   # [d, heads·hd]: new heads' columns zero
        out = _grow(data, 1, n_head * head_dim, "zero")
        return out if own else np.zeros_like(out)
    if kind in ("ffn_gate_exps", "ffn_up_exps"):  # [E, ff, d]: new rows zero
        return _grow(data, 1, n_ff_exp, "zero")
    if kind == "ffn_down_exps":                 # [E, d, ff]: new columns zero; all zero if padding
        out = _grow(data, 2, n_ff_exp, "zero")
        return out if own else np.zeros_like(out)
    return data


def pad_target(src: Path, dst: Path, n_layer: int, n_head: int, n_ff_exp: int, progress=None) -> Path:
    """Write the widened copy of `src` (a qwen3moe GGUF, F16) to `dst`; refuse to overwrite."""
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; not overwriting it")
    cfg = read_config(src)
    if cfg.arch != "qwen3moe":
        raise ValueError(f"{src.name}: only qwen3moe sources are supported, got {cfg.arch}")
    ratio = cfg.n_head // cfg.n_head_kv
    if n_layer < cfg.n_layer or n_head < cfg.n_head or n_ff_exp < cfg.n_ff_exp:
        raise ValueError("the widened model cannot be smaller than the source")
    if n_head % ratio or (n_head - cfg.n_head) * cfg.head_dim % LANES or (n_ff_exp - cfg.n_ff_exp) % LANES:
        raise ValueError(f"n_head must be a multiple of {ratio} and every new width a multiple of {LANES} elements")
    n_head_kv = n_head // ratio
    r = gguf.GGUFReader(src)
    arch = cfg.arch
    tensors = {t.name: t for t in r.tensors}
    key = lambda k: k.format(arch=arch)  # noqa: E731
    overrides = {key(gguf.Keys.LLM.BLOCK_COUNT): n_layer, key(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH): n_ff_exp,
                 key(gguf.Keys.Attention.HEAD_COUNT): n_head, key(gguf.Keys.Attention.HEAD_COUNT_KV): n_head_kv,
                 gguf.Keys.General.NAME: f"{cfg.name}-padded-{n_layer}x{n_head}h-ff{n_ff_exp}"}
    block_prefix = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM].split(".")[0]  # "blk"
    plan: list[tuple[str, BlockTensor | gguf.ReaderTensor]] = []
    for t in r.tensors:
        if not t.name.startswith(block_prefix + "."):
            plan.append((t.name, t))
    for pos in range(n_layer):
        b, own = source_block(pos, cfg.n_layer, n_layer)
        for t in r.tensors:
            parts = t.name.split(".")
            if parts[0] == block_prefix and int(parts[1]) == b:
                plan.append((".".join([parts[0], str(pos), *parts[2:]]), BlockTensor(t, parts[2], own)))

    def data(item) -> np.ndarray:
        if isinstance(item, BlockTensor):
            return padded_tensor(item.kind, np.asarray(item.src.data), item.own, n_head, n_head_kv, cfg.head_dim,
                                 n_ff_exp)
        return np.asarray(item.data)

    def qtype(item):
        return (item.src if isinstance(item, BlockTensor) else item).tensor_type

    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        _copy_metadata(r, w, overrides)
        shapes = {}
        for name, item in plan:
            shape = _shape_of(item, n_head, n_head_kv, cfg.head_dim, n_ff_exp)
            shapes[name] = shape
            arr_dtype = np.float16 if qtype(item) == gguf.GGMLQuantizationType.F16 else np.float32
            nbytes = int(np.prod(shape)) * np.dtype(arr_dtype).itemsize
            w.add_tensor_info(name, shape, np.dtype(arr_dtype), nbytes, raw_dtype=qtype(item))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, item in plan:
            arr = np.ascontiguousarray(data(item))
            if arr.shape != shapes[name]:
                raise AssertionError(f"{name}: {arr.shape} != {shapes[name]}")
            w.write_tensor_data(arr)
            if progress:
                progress(name)
        w.close()
    return dst


def _shape_of(item, n_head, n_head_kv, head_dim, n_ff_exp) -> tuple[int, ...]:
    if not isinstance(item, BlockTensor):
        return tuple(item.data.shape)
    kind = item.kind
    s = list(item.src.data.shape)
    if kind == "attn_q":
        s[0] = n_head * head_dim
    elif kind in ("attn_k", "attn_v"):
        s[0] = n_head_kv * head_dim
    elif kind == "attn_output":
        s[1] = n_head * head_dim
    elif kind in ("ffn_gate_exps", "ffn_up_exps"):
        s[1] = n_ff_exp
    elif kind == "ffn_down_exps":
        s[2] = n_ff_exp
    return tuple(s)


def bytes_per_token(path: Path) -> dict:
    """Bytes a one-token decode step reads: every non-expert tensor, top-k experts per layer."""
    cfg = read_config(path)
    r = gguf.GGUFReader(path)
    dense = expert = 0
    for t in r.tensors:
        if "_exps." in t.name:
            expert += int(t.n_bytes) * cfg.n_expert_used // cfg.n_expert
        else:
            dense += int(t.n_bytes)
    return {"dense_bytes": dense, "active_expert_bytes": expert, "bytes_per_token": dense + expert,
            "file_bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("out", type=Path, help="GGUF to write (never overwritten)")
    ap.add_argument("--source", type=Path, default=SOURCE, help="trained qwen3moe F16 target [shipped]")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="olmoe-bytes")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--n-ff-exp", type=int)
    args = ap.parse_args(argv)
    shape = dict(PRESETS[args.preset])
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if args.out.exists():
        print(f"error: {args.out} exists; not overwriting it", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        pad_target(args.source, args.out, **shape)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    info = bytes_per_token(args.out)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s: {shape}, {info['file_bytes'] / 2**30:.2f} GiB, "
          f"{info['bytes_per_token'] / 2**20:.0f} MiB per token "
          f"({info['dense_bytes'] / 2**20:.0f} dense + {info['active_expert_bytes'] / 2**20:.0f} experts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
