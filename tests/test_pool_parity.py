"""One eviction rule, two implementations: the native copy engine (`pick_slot` in the expert-pool
patch) and the simulator's `Pool.apply` must end with the same experts resident after the same
plans, with the same slot count. Plans are applied one at a time with no decode in between, so
no slot is frozen and every copy completes before the next plan."""

from __future__ import annotations

import numpy as np
import pytest

from engine_common import model_config
from orchestrator.gguf_files.gguf_export import make_random_model
from orchestrator.policies.plan import Plan
from orchestrator.sim.simulator import Pool

native = pytest.importorskip("orchestrator.runtime.native")
llm = pytest.importorskip("orchestrator.runtime.llm")

K_MAX = 4


def random_plans(rng, n_layer: int, n_expert: int, n: int):
    """Utility plans, some with explicit prefetch / evict lists (as the cache baselines send)."""
    for _ in range(n):
        utility = rng.integers(0, K_MAX + 1, size=(n_layer, n_expert)).astype(np.uint8)
        threshold = rng.integers(1, K_MAX + 1, size=n_layer).astype(np.int32)
        prefetch = evict = None
        kind = rng.integers(3)
        if kind >= 1:
            cells = np.argwhere(utility >= threshold[:, None])
            prefetch = rng.permutation(cells).astype(np.int32)
        if kind == 2:
            cells = np.argwhere(utility < threshold[:, None])
            evict = rng.permutation(cells)[:rng.integers(len(cells) + 1)].astype(np.int32)
        yield Plan(utility=utility, threshold=threshold, prefetch=prefetch, evict=evict)


@pytest.mark.parametrize("no_evict", [False, True], ids=["evict", "no_evict"])
@pytest.mark.parametrize("budget_ratio", [0.2, 0.5])
def test_native_pool_and_simulator_pool_agree(tmp_path, budget_ratio, no_evict):
    if not native.engine_built():
        pytest.skip("native engine not built")
    cfg = model_config("qwen3moe")
    path = make_random_model(tmp_path / "m.gguf", cfg, seed=3, dtype="f32")
    model = llm.Model(path)
    ctx = llm.Context(model, n_ctx=64, n_batch=16, n_threads=1)
    try:
        with native.ExpertEngine(ctx.ptr, path, budget_ratio=budget_ratio, no_evict=no_evict) as engine:
            capacity = int(engine.stats()["n_slots"])
            pool = Pool(engine.n_moe_layers, engine.n_expert, capacity, costs=None)
            rng = np.random.default_rng(int(budget_ratio * 100) + no_evict)
            for step, plan in enumerate(random_plans(rng, engine.n_moe_layers, engine.n_expert, 60)):
                engine.set_plan(plan)
                assert engine.wait_idle()
                pool.apply(plan, now=0.0, free=True, evicts=not no_evict)
                resident = engine.residency() >= 0
                diff = np.argwhere(resident != pool.allocated)
                assert not len(diff), f"step {step}: native and simulator differ at (layer, expert) {diff[:5].tolist()}"
                assert resident.sum() <= capacity
    finally:
        ctx.close()
        model.close()
