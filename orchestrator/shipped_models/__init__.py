"""spac's shipped default models (this package's data: the GGUF files and MANIFEST.json beside
this module, installed with the package) and how to open a GGUF in llama.cpp.

    from orchestrator.shipped_models import default_model, load_llama
    llm = load_llama(default_model("target"), n_ctx=256)

`MANIFEST.json` lists every shipped file with its sha256, role and measured numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path

# package data: a real directory in a regular and in an editable install alike
MODELS_DIR = Path(str(resources.files(__name__)))
GGML_TYPE_F32 = 0


def manifest(models_dir: Path = MODELS_DIR) -> dict:
    path = models_dir / "MANIFEST.json"
    if not path.is_file():
        raise FileNotFoundError(f"no shipped models: {path} is missing")
    return json.loads(path.read_text())


def default_model(role: str = "target", models_dir: Path = MODELS_DIR) -> Path:
    """Path of the shipped model with this role: "target", "draft" (the default draft),
    or a file name listed in the manifest."""
    m = manifest(models_dir)
    if role == "draft":
        role = m["default_draft"]
    for f in m["files"]:
        if role in (f["role"], f["file"]):
            return models_dir / f["file"]
    raise KeyError(f"no shipped model with role {role!r}; have {[f['role'] for f in m['files']]}")


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_llama(path: str | os.PathLike[str], n_ctx: int = 512, f32_kv: bool = False, extra_bufts: bool = False,
               **kwargs):
    """llama_cpp.Llama for `path` with logits for every token.

    f32_kv: F32 K/V cache (for comparing logits with a reference implementation).
    extra_bufts: llama.cpp's extra CPU buffer types (weight repacking, AMX). Off by default:
    the reference path of the tests is the file's own layout, and repacking makes no difference
    at these sizes."""
    import llama_cpp
    import llama_cpp.llama_cpp as capi

    if f32_kv:
        kwargs.setdefault("type_k", GGML_TYPE_F32)
        kwargs.setdefault("type_v", GGML_TYPE_F32)
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("n_batch", n_ctx)
    original = capi.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = extra_bufts
        return p

    capi.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, **kwargs)
    finally:
        capi.llama_model_default_params = original
