"""The expert pool on a real second device: the ggml RPC backend on 127.0.0.1.

A server process exposes its CPU as an RPC device; a client process registers it, so llama.cpp
sees two devices and the pool lives in the server's memory. Uploads go through the device API
(RPC set_tensor), the pool half of every MoE layer is computed by the server. The client runs
in its own process too: a registered RPC device cannot be unregistered, and once its server is
gone every later model load in the process would try to reach it.
"""

from __future__ import annotations

import numpy as np

from orchestrator.runtime.native import graph_n_crossings, graph_n_splits
from orchestrator.gguf_files.gguf_export import make_random_model
from orchestrator.policies.plan import Plan

from engine_common import PROMPT, model_config, rpc_main, run_in_own_process, run_sequence, tensor_reader


def check_pool_on_rpc_device(rpc_device, tmp_path):
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine

    path = make_random_model(tmp_path / "m.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        reference = run_sequence(ctx)
        assert graph_n_crossings(ctx.ptr) == 0 and graph_n_splits(ctx.ptr) == 1
        crossings = {}
        for split_graph, join, skip in (("overlap", "auto", False), ("overlap", "per-expert", False),
                                        ("overlap", "auto", True), ("per-matmul", "auto", False)):
            rng = np.random.default_rng(0)
            with ExpertEngine(ctx.ptr, path, device=rpc_device, budget_ratio=0.5, split_graph=split_graph,
                              join=join, skip_absent=skip) as engine:
                L, E = engine.n_moe_layers, engine.n_expert
                for i in range(10):
                    utility = rng.integers(0, 5, (L, E)).astype(np.uint8)
                    engine.set_plan(Plan(utility, np.full(L, 2, np.int32)))
                    assert engine.wait_idle(60)
                    got = run_sequence(ctx)
                    np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
                # every layer on the host, the pool on the server: each split MoE layer goes
                # host -> device -> host, twice per expert matmul in the per-matmul graph
                crossings[split_graph, join, skip] = graph_n_crossings(ctx.ptr) / L
                assert graph_n_splits(ctx.ptr) >= graph_n_crossings(ctx.ptr) + 1
                stats = engine.stats()
                assert stats["bytes_copied"] > 0 and stats["n_copies"] > 0
                assert stats["n_expert_tokens_device"] > 0
                assert (engine.residency() >= 0).sum() == stats["n_resident"] > 0
        print("crossings per MoE layer:", crossings)
        assert set(c for (graph, *_), c in crossings.items() if graph == "overlap") == {2}
        assert crossings["per-matmul", "auto", False] == 6
        assert len(PROMPT) == 8
    finally:
        ctx.close()
        model.close()


def check_device_ids_distinct(rpc_device, tmp_path):
    """Every token's device ids are distinct, whatever is resident: CUDA's MUL_MAT_ID kernels
    that group rows by expert (mmf, mmq) leave rows unwritten when a token names one slot twice,
    as it did when every non-resident expert went to one zero slot (patch 0013)."""
    from llama_cpp import llama_cpp as low

    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine

    ggml = tensor_reader()
    seen = []

    @low.ggml_backend_sched_eval_callback
    def cb(tensor, ask, user_data):
        is_ids = ggml.ggml_get_name(tensor).decode().startswith("ffn_moe_ids_dev-")
        if ask or not is_ids:
            return is_ids if ask else True
        ids = np.empty(ggml.ggml_nelements(tensor), dtype=np.int32)
        ggml.ggml_backend_tensor_get(tensor, ids.ctypes.data, 0, ids.nbytes)
        seen.append(ids.reshape(-1, 4))  # [n_tokens, n_expert_used]
        return True

    path = make_random_model(tmp_path / "ids.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
    model = Model(path, n_gpu_layers=99, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2, cb_eval=cb)
    try:
        with ExpertEngine(ctx.ptr, path, device=rpc_device, budget_ratio=0.25) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            for utility in (np.zeros((L, E), np.uint8), np.random.default_rng(1).integers(0, 5, (L, E)).astype(np.uint8)):
                engine.set_plan(Plan(utility, np.full(L, 2, np.int32)))
                assert engine.wait_idle(60)
                seen.clear()
                run_sequence(ctx)
                assert seen
                for ids in seen:
                    assert all(len(set(row)) == len(row) for row in ids.tolist()), ids
            n_slots = engine.stats()["n_slots"]
            assert max(int(ids.max()) for ids in seen) < n_slots + 4  # the zero slots follow the pool's
    finally:
        ctx.close()
        model.close()


def check_pin_mapping_falls_back(rpc_device, tmp_path):
    """--pin-mapping on a device that cannot register host memory (the RPC backend): nothing is
    pinned, the stats say so, and the pool computes what it computes without the option."""
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine

    path = make_random_model(tmp_path / "pin.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
    model = Model(path, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        out = {}
        for pin in (False, True):
            with ExpertEngine(ctx.ptr, path, device=rpc_device, budget_ratio=0.5, pin_mapping=pin) as engine:
                L, E = engine.n_moe_layers, engine.n_expert
                engine.set_plan(Plan(np.random.default_rng(1).integers(0, 5, (L, E)).astype(np.uint8), np.full(L, 2, np.int32)))
                assert engine.wait_idle(60)
                out[pin] = run_sequence(ctx)
                assert engine.stats()["bytes_pinned"] == 0
        assert out[True].tobytes() == out[False].tobytes()
    finally:
        ctx.close()
        model.close()


def check_full_pool_runs_the_device_half_alone(rpc_device, tmp_path):
    """Every layer and every expert on the device (a pool of every expert, patch 0026): no MoE
    layer crosses to the host, as with llama.cpp's experts on the device; the logits are those of
    the experts left on the host, to the RPC device's tolerance; a 40-token prompt too."""
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine, graph_crossings

    path = make_random_model(tmp_path / "full.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
    model = Model(path, n_gpu_layers=99, repack="off")
    ctx = Context(model, n_ctx=64, n_batch=48, n_threads=2, op_offload=False)
    prompt = list(range(40, 80))
    try:
        ctx.decode(prompt)
        reference = ctx.logits().copy()
        with ExpertEngine(ctx.ptr, path, device=rpc_device, budget_ratio=1.0, stream_prefill="ahead") as engine:
            assert (engine.residency() >= 0).all()
            for tokens in (prompt, [7]):  # a prompt, then one token after it
                if len(tokens) > 1:
                    ctx.clear()
                ctx.decode(tokens)
                crossings = graph_crossings(ctx.ptr)
                assert not any("ffn_moe" in c for c in crossings), crossings
            ctx.clear()
            ctx.decode(prompt)
            np.testing.assert_allclose(ctx.logits(), reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
            s = engine.stats()
            assert s["n_expert_tokens_cpu"] == 0 and s["n_staged"] == 0
    finally:
        ctx.close()
        model.close()


def check_on_rpc_device(rpc_device, tmp_path):
    check_pool_on_rpc_device(rpc_device, tmp_path)
    check_full_pool_runs_the_device_half_alone(rpc_device, tmp_path)
    check_device_ids_distinct(rpc_device, tmp_path)
    check_pin_mapping_falls_back(rpc_device, tmp_path)


def test_pool_on_rpc_device_matches_feature_off(tmp_path):
    """Also: a pool of every expert runs the device half alone (check_full_pool_runs_the_device_half_alone);
    every token's device ids are distinct (check_device_ids_distinct); --pin-mapping falls back on a
    device that cannot pin (check_pin_mapping_falls_back)."""
    run_in_own_process(__file__, tmp_path)


if __name__ == "__main__":
    rpc_main(check_on_rpc_device)
