"""The expert pool over several devices (patch 0018): two RPC servers on 127.0.0.1 are two
devices; llama.cpp's layer split puts half the layers on each, and each device's pool holds the
experts of its own layers. The client runs in a process of its own (a registered RPC device
cannot be unregistered)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.runtime.native import engine_built

from engine_common import rpc_main, run_in_own_process
from test_engine_archs import ARCHS, arch_models  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.skipif(not engine_built(), reason="native engine not built")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
# per device, a share of its own layers' experts: llama.cpp's architecture models have 2 experts
# a layer, so a device holding one layer holds one of its experts at most (25% per device: the
# CLI test on the shipped model)
BUDGETS = [(0.5, 0.5), (0.5, 1.0)]


def check_every_arch_on_two_devices(devices: list[str], arch_dir: Path) -> None:
    """Per architecture: the target with its layers on two devices decodes greedily alone, then
    verifying a pool draft of itself through pools on both devices while random plans change
    them; the tokens must be the same, and both devices must have copied and computed."""
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import SeveralPools, model_layer_devices, model_moe_layers
    from orchestrator.runtime.pool import Budget, PoolDevice
    from orchestrator.runtime.placement import pool_layer_ranges

    from test_pool_draft import greedy, speculative_greedy

    from orchestrator.gguf_files.gguf_export import make_random_model

    from engine_common import model_config

    # llama.cpp's writer: 2 layers of 2 experts (one layer per device, split 1:2: an even split by
    # free memory would put both on the first); spac's own: 4 layers of 16 experts, 25% per device
    cases = [(arch_dir / f"{arch}-moe.gguf", (1, 2), BUDGETS) for arch in ARCHS]
    cases += [(make_random_model(arch_dir / f"{arch}-16x4.gguf", model_config(arch), seed=3, dtype="f32", quant="q8_0"),
               (1, 1), [(0.25, 0.25), (0.25, 0.5)]) for arch in ("qwen3moe", "qwen2moe")]
    for path, split, budgets_tried in cases:
        arch = path.stem
        model = Model(path, repack="off", n_gpu_layers=99, devices=tuple(devices), tensor_split=split)
        ctx = Context(model, n_ctx=128, n_batch=16, n_threads=1)
        dctx = Context(model, n_ctx=128, n_batch=16, n_threads=1)
        try:
            placed = model_layer_devices(model.ptr, model.n_layer)
            assert set(placed) == set(devices), placed  # llama.cpp split the layers over both
            moe = model_moe_layers(model.ptr, model.n_layer)
            layers = pool_layer_ranges(placed, devices, moe)  # deepseek2: layer 0 dense, no pool on the first
            ref = greedy(ctx, PROMPT, 24)
            for budgets in budgets_tried:
                pools = [PoolDevice(d, Budget(ratio=b), span) for d, b, span in zip(devices, budgets, layers)]
                with SeveralPools(ctx.ptr, path, pools) as engine:
                    engine.attach_draft(dctx.ptr)
                    out, n_accepted = speculative_greedy(ctx, dctx, engine, PROMPT, 24)
                    assert out == ref, (arch, budgets)
                    per_device = engine.stats()["per_device"]
                    print(f"{arch} {budgets} layers {layers}: {n_accepted} drafts accepted; " +
                          ", ".join(f"{d['device']} {d['bytes_copied']} B copied, {d['n_slots']} slots" for d in per_device))
                    for d in per_device:
                        assert d["bytes_copied"] > 0 and d["n_expert_tokens_device"] > 0, (arch, budgets, d)
                    # each device's pool holds only its own layers' experts
                    assert len(per_device) == sum(span is not None for span in layers)
                    for e, (begin, end) in zip(engine.engines, [s for s in layers if s is not None]):
                        rows = np.flatnonzero((e.residency() >= 0).any(axis=1))
                        held = [m for m, il in enumerate(moe) if begin <= il < end]
                        assert set(rows) <= set(held), (arch, e.device, rows, held)
        finally:
            dctx.close()
            ctx.close()
            model.close()


def check_overlapping_pools_are_refused(devices: list[str], arch_dir: Path) -> None:
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine, NativeError

    path = arch_dir / "qwen3moe-moe.gguf"
    model = Model(path, repack="off", n_gpu_layers=99, devices=tuple(devices))
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=1)
    try:
        assert model.n_layer == 2
        with ExpertEngine(ctx.ptr, path, device=devices[0], budget_ratio=0.5, layers=(0, 1)):
            with pytest.raises(NativeError, match="already have a pool"):
                ExpertEngine(ctx.ptr, path, device=devices[1], budget_ratio=0.5, layers=(0, 0))
            with ExpertEngine(ctx.ptr, path, device=devices[1], budget_ratio=0.5, layers=(1, 0)):
                pass
            with pytest.raises(NativeError, match="hold no MoE layer"):
                ExpertEngine(ctx.ptr, path, device=devices[1], budget_ratio=0.5, layers=(2, 0))
    finally:
        ctx.close()
        model.close()


def check_streamed_prefill_on_two_devices(devices: list[str], tmp: Path) -> None:
    """A 700-token prompt streams its experts through both pools, each device its own layers'
    (the staging copies of the second device start with the ubatch, beside the first's)."""
    from orchestrator.gguf_files.gguf_export import make_random_model
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine, SeveralPools, model_layer_devices
    from orchestrator.runtime.pool import Budget, PoolDevice, StreamPrefill
    from orchestrator.runtime.placement import pool_layer_ranges
    from orchestrator.policies.plan import Plan

    from engine_common import model_config

    path = make_random_model(tmp / "m.gguf", model_config("qwen3moe"), seed=1, dtype="f32", quant="q8_0")
    model = Model(path, repack="off", n_gpu_layers=4, devices=tuple(devices))
    ctx = Context(model, n_ctx=1024, n_batch=512, n_threads=1)
    try:
        tokens = np.random.default_rng(0).integers(0, 250, 700)
        ctx.decode(tokens, logits_all=True)
        reference = ctx.logits().copy()
        layers = pool_layer_ranges(model_layer_devices(model.ptr, 4), devices)
        assert layers == [(0, 3), (3, 4)], layers  # 4 layers and the output, split evenly
        pools = [PoolDevice(d, Budget(ratio=0.25), span) for d, span in zip(devices, layers)]
        with SeveralPools(ctx.ptr, path, pools, stream_prefill=StreamPrefill.AHEAD) as engine:
            ctx.clear()
            ctx.decode(tokens, logits_all=True)
            got = ctx.logits().copy()
            np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
            stats = engine.stats()
            assert stats["n_expert_tokens_cpu"] == 0
            assert all(d["bytes_staged"] > 0 for d in stats["per_device"]), stats["per_device"]
        # a device without room for staging slots does not stream: its layers keep upstream's
        # prefill, but the model's last layer keeps only the output rows and splits, reading the
        # split maps its pool fills beside the other's stage map
        ctx.clear()
        ctx.decode(tokens, logits_all=False)
        reference = ctx.logits()[-1].copy()
        with ExpertEngine(ctx.ptr, path, device=devices[0], budget_ratio=0.25, stream_prefill=StreamPrefill.AHEAD, layers=layers[0]), \
             ExpertEngine(ctx.ptr, path, device=devices[1], budget_ratio=0.25, stream_prefill=StreamPrefill.OFF, layers=layers[1]) as last:
            last.set_plan(Plan(np.full((4, 16), 1, np.uint8), np.ones(4, np.int32)))  # some resident: a real split
            assert last.wait_idle()
            ctx.clear()
            ctx.decode(tokens, logits_all=False)
            got = ctx.logits()[-1].copy()
            np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
            assert last.stats()["n_expert_tokens_device"] > 0  # its last layer split
    finally:
        ctx.close()
        model.close()


def check_two_devices(devices: list[str], arch_dir: Path) -> None:
    check_overlapping_pools_are_refused(devices, arch_dir)
    check_every_arch_on_two_devices(devices, arch_dir)
    check_streamed_prefill_on_two_devices(devices, arch_dir)


def test_every_split_architecture_on_two_rpc_devices(arch_models):  # noqa: F811
    run_in_own_process(__file__, arch_models)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    rpc_main(check_two_devices, n_devices=2)
