"""The hot-expert self-draft (SpecMoE §III-B): a copy of a MoE GGUF that keeps, in every
layer, the N experts most used in a routing profile (router rows sliced to match). Streams one
tensor at a time and works on any quantization. `spac draft hot-experts` (orchestrator/cli/drafts.py)
is its command."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
from gguf import MODEL_TENSOR

from orchestrator.gguf_files.gguf_export import atomic_path

_EXPERT_TENSORS = (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP,
                   MODEL_TENSOR.FFN_GATE_UP_EXP, MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.FFN_EXP_PROBS_B)


def hot_experts(profile: np.ndarray, n_keep: int) -> list[list[int]]:
    """Per layer, the ids (ascending) of the `n_keep` most-used experts of a usage profile
    int [n_layer, n_expert] (ties: lower id first)."""
    profile = np.asarray(profile)
    if profile.ndim != 2:
        raise ValueError(f"routing profile must be [n_layer, n_expert], got shape {profile.shape}")
    if not 0 < n_keep <= profile.shape[1]:
        raise ValueError(f"n_keep must be in 1..{profile.shape[1]}, got {n_keep}")
    return [sorted(np.argsort(-row, kind="stable")[:n_keep].tolist()) for row in profile]


def _copy_metadata(r: gguf.GGUFReader, w: gguf.GGUFWriter, overrides: Mapping[str, int]) -> None:
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.ALIGNMENT):
            continue
        if name in overrides:
            w.add_key_value(name, overrides[name], f.types[0])
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])


def slice_experts(src: str | os.PathLike[str], dst: str | os.PathLike[str], keep: list[list[int]],
                  progress: Callable[[str, int], None] | None = None) -> Path:
    """Copy a MoE GGUF keeping, in layer i, only experts keep[i] (router rows sliced to match).

    Works on any quantization (an expert's rows are contiguous in the file) and streams one
    tensor at a time. Every layer must keep the same number of experts (one expert_count key)."""
    r = gguf.GGUFReader(src)
    arch = r.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    k_count = gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch)
    k_used = gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)
    if r.get_field(k_count) is None:
        raise ValueError(f"{Path(src).name} is not a MoE model (no {k_count})")
    n_expert = int(r.get_field(k_count).contents())
    n_keep = {len(k) for k in keep}
    if len(n_keep) != 1:
        raise ValueError("every layer must keep the same number of experts")
    n_keep = n_keep.pop()
    for i, ids in enumerate(keep):
        if len(set(ids)) != len(ids) or not all(0 <= e < n_expert for e in ids):
            raise ValueError(f"layer {i}: expert ids must be distinct and in 0..{n_expert - 1}")
    expert_names = {
        f"{gguf.TENSOR_NAMES[t].format(bid=i)}.{s}": i
        for t in _EXPERT_TENSORS for i in range(len(keep)) for s in ("weight", "bias", "scale")}
    used = int(r.get_field(k_used).contents())
    plan = []
    for t in r.tensors:
        data = t.data
        layer = expert_names.get(t.name)
        if layer is not None and data.shape[0] == n_expert:
            plan.append((t, keep[layer]))
        elif layer is not None:
            raise ValueError(f"{t.name}: leading dimension {data.shape[0]} != expert_count {n_expert}")
        else:
            plan.append((t, None))
    if all(ids is None for _, ids in plan):
        raise ValueError(f"{Path(src).name} has no expert tensors")
    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        _copy_metadata(r, w, {k_count: n_keep, k_used: min(used, n_keep)})
        for t, ids in plan:
            shape = (n_keep, *t.data.shape[1:]) if ids is not None else t.data.shape
            nbytes = int(t.n_bytes // t.data.shape[0] * shape[0])
            w.add_tensor_info(t.name, shape, t.data.dtype, nbytes, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, ids in plan:
            w.write_tensor_data(np.ascontiguousarray(t.data[ids] if ids is not None else t.data))
            if progress:
                progress(t.name, int(t.n_bytes))
        w.close()
    return Path(dst)
