"""Helpers shared by the engine tests: a small MoE shape, a fixed decode sequence, and checks
that run in a process of their own beside an RPC server."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np

from orchestrator.runtime.llm import Context
from orchestrator.gguf_files.gguf_export import tiny_config

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64]   # one 8-token ubatch (split), then single tokens
NEXT = [12, 200, 3]


def model_config(arch: str):
    # dims every tested quant type can hold (rows of 32); 4 layers, 16 experts top-4
    return tiny_config(arch, n_layer=4, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64,
                       **({"n_ff_shexp": 64} if arch == "qwen2moe" else {}))


def run_sequence(ctx: Context) -> np.ndarray:
    """Logits of the prompt (all 8 positions) and of 3 single-token decodes."""
    ctx.clear()
    ctx.decode(PROMPT)
    out = [ctx.logits().copy()]
    for t in NEXT:
        ctx.decode([t])
        out.append(ctx.logits().copy())
    return np.concatenate(out)


def decode_runs(ctx: Context, runs: list[list[int]]) -> list[np.ndarray]:
    """The logits after each run of tokens, decoded one ubatch each from an empty cache."""
    ctx.clear()
    out = []
    for run in runs:
        ctx.decode(run)
        out.append(ctx.logits().copy())
    return out


def tensor_reader():
    """ggml-base with what an eval callback needs to read a tensor: name, element count, data."""
    import ctypes

    from orchestrator.runtime.native import ggml_library

    ggml = ggml_library("ggml-base")
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nelements.restype = ctypes.c_int64
    ggml.ggml_nelements.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return ggml


def run_in_own_process(test_file: str, tmp_path: Path) -> None:
    """Run `python test_file tmp_path` (its __main__ calls `rpc_main`): an RPC client in its own
    process, so a failure there cannot take the test session down. Fails with its output."""
    res = subprocess.run([sys.executable, test_file, str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=Path(test_file).parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def rpc_main(check, n_devices: int = 1) -> None:
    """A test file's __main__: check(device, Path(argv[1])) with an RPC server on 127.0.0.1, or
    on the device SPAC_TEST_DEVICE names (CUDA0 on a GPU machine: the same checks on a real GPU).
    n_devices > 1: check(list of device names, ...), as many servers (SPAC_TEST_DEVICE: a
    comma-separated list)."""
    import os

    from orchestrator.runtime.rpc import rpc_devices

    named = os.environ.get("SPAC_TEST_DEVICE")
    with rpc_devices(n_devices) if not named else contextlib.nullcontext(named.split(",")) as devices:
        check(devices[0] if n_devices == 1 else devices, Path(sys.argv[1]))


def session_engine_stats(model_path, tmp_path: Path, make_policy) -> list[dict]:
    """A session with a 25% CPU pool run by `make_policy()`, without a draft and with the pool
    draft (γ 4): each gives target-only's 24 greedy tokens (asserted); their engines' stats."""
    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.decoding.speculative import POOL_DRAFT, Session, SessionConfig
    from orchestrator.runtime.pool import Budget, PoolDevice

    greedy = SamplingParams(temperature=0)
    base = dict(model=model_path, n_ctx=256, n_threads=2, repack="off", calibration_cache=tmp_path / "cal.json")
    prompt = [1, 2, 3, 4, 5, 6]
    with Session(SessionConfig(**base, expert_engine=False)) as plain:
        want = plain.complete(prompt, 24, sampling=greedy).tokens
    stats = []
    for draft in (None, POOL_DRAFT):
        cfg = SessionConfig(**base, draft=draft, gamma=4, adaptive_gamma=False, pool=(PoolDevice("CPU", Budget(ratio=0.25)),))
        with Session(cfg, policy=make_policy()) as s:
            assert s.complete(prompt, 24, sampling=greedy).tokens == want, f"draft {draft}"
            stats.append(s.engine.stats())
    return stats
