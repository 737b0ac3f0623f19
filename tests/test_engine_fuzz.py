"""Plan-API fuzzer: random and malformed plans, budgets and id arrays straight into the C API.

Every call either succeeds or returns an error with a message; nothing crashes, and the engine
still computes bit-identical logits afterwards. SPAC_FUZZ_CASES sets the number of cases (a
short run by default; scripts/sanitize.sh runs 10,000 under AddressSanitizer).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from orchestrator.runtime.llm import Context, Model
from orchestrator.runtime.native import ExpertEngine, lib
from orchestrator.gguf_files.gguf_export import make_random_model
from orchestrator.policies.plan import Plan

from engine_common import model_config, run_sequence

N_CASES = int(os.environ.get("SPAC_FUZZ_CASES", "400"))
INT32_EXTREMES = [-(2**31), -2, -1, 0, 1, 2**31 - 1]


def ints(rng, n: int, valid_high: int) -> np.ndarray:
    """Mostly valid values in [0, valid_high), some out of range or extreme."""
    out = rng.integers(0, max(valid_high, 1), n)
    bad = rng.random(n) < 0.01
    out[bad] = rng.choice(INT32_EXTREMES + [valid_high, valid_high + 7], bad.sum())
    return out.astype(np.int32)


def pairs(rng, L: int, E: int):
    """(array or None, count passed): valid, out of range, negative count, or NULL with a count."""
    case = rng.choice(6, p=[0.3, 0.05, 0.05, 0.2, 0.2, 0.2])
    if case == 0:
        return None, 0
    if case == 1:
        return None, int(rng.integers(1, 5))  # NULL with n > 0
    n = int(rng.integers(0, 12))
    arr = np.stack([ints(rng, n, L), ints(rng, n, E)], axis=1) if n else np.zeros((0, 2), np.int32)
    arr = np.ascontiguousarray(arr, dtype=np.int32)
    count = n if case != 2 else -int(rng.integers(1, 3))
    return arr, count


def plan_is_valid(threshold, pre, n_pre, ev, n_ev, L: int, E: int) -> bool:
    def ok(arr, n):
        if n < 0 or (n > 0 and arr is None):
            return False
        return n == 0 or bool(((arr[:n, 0] >= 0) & (arr[:n, 0] < L) & (arr[:n, 1] >= 0) & (arr[:n, 1] < E)).all())
    return bool((threshold >= 1).all()) and ok(pre, n_pre) and ok(ev, n_ev)


def fuzz_plan(rng, eng, L: int, E: int, err) -> bool:
    utility = rng.integers(0, 256, (L, E), dtype=np.uint8)
    threshold = ints(rng, L, 6) if rng.random() < 0.2 else rng.integers(1, 6, L).astype(np.int32)
    pre, n_pre = pairs(rng, L, E)
    ev, n_ev = pairs(rng, L, E)
    null_util = rng.random() < 0.02
    err.value = b""
    rc = lib()["set_plan"](eng, None if null_util else utility.ctypes.data, threshold.ctypes.data,
                           pre.ctypes.data if pre is not None else None, n_pre,
                           ev.ctypes.data if ev is not None else None, n_ev, err, len(err))
    valid = not null_util and plan_is_valid(threshold, pre, n_pre, ev, n_ev, L, E)
    assert rc == (0 if valid else -1), (rc, valid, err.value)
    assert valid or err.value, "an error without a message"
    return valid


def pick(rng, valid: list, invalid: list, p_valid: float = 0.85):
    pool = valid if rng.random() < p_valid or not invalid else invalid
    return pool[rng.integers(len(pool))]


def fuzz_create(rng, ctx, path: str, other_path: str, err) -> bool:
    p = lib()["default_params"]()
    model_path = pick(rng, [path], [other_path, "/nonexistent.gguf", __file__, None])
    p.model_path = str(model_path).encode() if model_path is not None else None
    device = pick(rng, ["CPU", None], ["", "nope", "RPC7[127.0.0.1:1]"])
    p.device = str(device).encode() if device is not None else None
    p.budget_bytes = pick(rng, [0, 1 << 20], [1, 4096, 2**63, 2**64 - 1])
    p.budget_ratio = pick(rng, [0.3, 1.0, 7.0], [0.0, -1.0, float("nan"), float("inf"), 1e-9])
    p.max_split_tokens = pick(rng, INT32_EXTREMES + [16], [])
    p.no_evict = bool(rng.random() < 0.5)
    p.copy_delay_us = pick(rng, [-5, 0, 10], [])
    p.split_graph = pick(rng, [0, 1], [2, -1])
    p.join = pick(rng, [0, 1, 2], [3, -7])
    p.skip_absent = bool(rng.random() < 0.2)
    p.only_half = pick(rng, [0, 0, 1, 2], [3, -1])
    err.value = b""
    eng = lib()["create"](ctx.ptr, ctypes.byref(p), err, len(err))
    if not eng:
        assert err.value, "creation refused without a message"
        return False
    if rng.random() < 0.3:
        ctx.clear()
        ctx.decode([int(t) for t in rng.integers(0, 200, int(rng.integers(1, 20)))])
    lib()["free"](eng)
    return True


def test_plan_api_fuzz(tmp_path):
    path = make_random_model(tmp_path / "m.gguf", model_config("qwen3moe"), seed=4, dtype="f32", quant="q8_0")
    other = make_random_model(tmp_path / "other.gguf", model_config("qwen3moe"), seed=5, dtype="f32", quant="q8_0")
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=32, n_threads=1)
    spare = Context(model, n_ctx=64, n_batch=32, n_threads=1)  # engines created and freed here
    rng = np.random.default_rng(11)
    err = ctypes.create_string_buffer(256)
    counts = {"plans ok": 0, "plans refused": 0, "engines": 0, "engines refused": 0, "decodes": 0}
    try:
        reference = run_sequence(ctx)
        with ExpertEngine(ctx.ptr, path, budget_ratio=0.5, copy_delay_us=50) as engine:
            eng, L, E = engine._eng, engine.n_moe_layers, engine.n_expert
            for i in range(N_CASES):
                r = rng.random()
                if r < 0.70:
                    counts["plans ok" if fuzz_plan(rng, eng, L, E, err) else "plans refused"] += 1
                elif r < 0.90:
                    made = fuzz_create(rng, spare, str(path), str(other), err)
                    counts["engines" if made else "engines refused"] += 1
                else:
                    # decodes while the worker copies the last plan; odd sizes cross max_split_tokens
                    ctx.clear()
                    ctx.decode([int(t) for t in rng.integers(0, 200, int(rng.integers(1, 30)))])
                    lib()["wait_idle"](eng, int(rng.integers(0, 3)))
                    counts["decodes"] += 1
            print(f"{N_CASES} cases: {counts}")
            # still exact after all that
            engine.set_plan(Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), np.full(L, 2, np.int32)))
            assert engine.wait_idle(60)
            assert run_sequence(ctx).tobytes() == reference.tobytes()
        assert counts["plans refused"] > 0 and counts["plans ok"] > 0 and counts["engines refused"] > 0
    finally:
        spare.close()
        ctx.close()
        model.close()
