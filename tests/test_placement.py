"""The default placement rule (orchestrator.runtime.placement.place): a pure function of model sizes,
free device memory and the options, tested without a GPU; and the shared option block."""

from __future__ import annotations

import inspect

import pytest
import typer

from orchestrator.cli.options import OPTIONS, RunOptions, run_options
from orchestrator.runtime.native import engine_built
from orchestrator.runtime.placement import (GPU, MARGIN, ModelSizes, PlacementError, layer_split, model_sizes, place,
                                           place_several, pool_layer_ranges)
from orchestrator.runtime.pool import Budget, PoolDevice

GiB = 1 << 30
# a Qwen3-30B-A3B-like Q4_K model: 48 layers, 16.5 GiB of experts, 1.5 GiB of the rest
QWEN = ModelSizes(n_layer=48, expert_bytes=int(16.5 * GiB), non_expert_bytes=int(1.5 * GiB),
                  kv_bytes_per_token=98304, n_experts_total=48 * 128, n_ctx_train=40960)


def test_no_gpu_pool_off_in_one_line():
    p = place(QWEN, 4096, None, None, Budget())
    assert p.device is None and p.n_gpu_layers == 0 and "no GPU" in p.note and "--device CPU" in p.note
    with pytest.raises(PlacementError, match="--engine"):
        place(QWEN, 4096, None, None, Budget(), expert_engine=True)


def test_gpu_takes_every_layer_and_the_rest_goes_to_the_pool():
    gpu = GPU("CUDA0", free=12 * GiB, total=12 * GiB)
    p = place(QWEN, 4096, gpu, None, Budget())
    used = QWEN.non_expert_bytes + QWEN.kv_bytes_per_token * 4096
    assert p.device == "CUDA0" and p.n_gpu_layers == 48
    assert p.pool[0].budget.nbytes == 12 * GiB - used - MARGIN
    assert "48/48 layers on CUDA0" in p.note


def test_pool_shrinks_with_the_context_and_is_capped_by_the_experts():
    gpu = GPU("CUDA0", free=12 * GiB, total=12 * GiB)
    assert place(QWEN, 32768, gpu, None, Budget()).pool[0].budget.nbytes < place(QWEN, 4096, gpu, None, Budget()).pool[0].budget.nbytes
    big = GPU("CUDA0", free=80 * GiB, total=80 * GiB)
    assert place(QWEN, 4096, big, None, Budget()).pool[0].budget.nbytes == QWEN.expert_bytes


def test_small_gpu_gets_some_layers_and_no_pool():
    gpu = GPU("CUDA0", free=int(1.8 * GiB), total=2 * GiB)
    p = place(QWEN, 4096, gpu, None, Budget())
    assert 0 < p.n_gpu_layers < 48 and p.device is None and "full" in p.note


def test_overrides_win():
    gpu = GPU("CUDA0", free=12 * GiB, total=12 * GiB)
    p = place(QWEN, 4096, gpu, None, Budget(nbytes=4 * GiB), ngl="10")
    assert p.n_gpu_layers == 10 and p.pool[0].budget.nbytes == 4 * GiB
    assert place(QWEN, 4096, gpu, None, Budget(ratio=0.25)).pool[0].budget.nbytes == int(0.25 * QWEN.expert_bytes)
    with pytest.raises(PlacementError, match="--expert-budget"):
        place(QWEN, 4096, gpu, None, Budget(nbytes=16 * GiB))
    off = place(QWEN, 4096, gpu, None, Budget(), expert_engine=False)
    assert off.device is None and off.n_gpu_layers == 48 and "--no-engine" in off.note


def test_cpu_test_device_and_named_devices():
    p = place(QWEN, 4096, None, "CPU", Budget())
    assert p.device == "CPU" and p.pool[0].budget.ratio == 0.25 and p.n_gpu_layers == 0
    all_of_it = place(QWEN, 4096, None, "CPU", Budget(nbytes=999 * GiB))
    assert all_of_it.pool[0].budget.nbytes == QWEN.expert_bytes and "every expert" in all_of_it.note
    rpc = place(QWEN, 4096, None, "RPC0[127.0.0.1:5000]", Budget(ratio=0.5), ngl="all")
    assert rpc.device.startswith("RPC0") and rpc.pool[0].budget.ratio == 0.5 and rpc.n_gpu_layers == 48


def test_dense_model_has_no_pool():
    dense = ModelSizes(n_layer=2, expert_bytes=0, non_expert_bytes=5 << 20, kv_bytes_per_token=1024)
    p = place(dense, 512, GPU("CUDA0", 8 * GiB, 8 * GiB), None, Budget())
    assert p.device is None and "no routed experts" in p.note and p.n_gpu_layers == 2


def test_model_sizes_of_the_shipped_target():
    from orchestrator.shipped_models import default_model

    s = model_sizes(default_model("target"))
    assert s.n_layer == 6 and s.n_experts_total == 6 * 32 and s.expert_bytes > s.non_expert_bytes > 0


@pytest.mark.parametrize("text,expected", [("25%", Budget(ratio=0.25)), ("512M", Budget(nbytes=512_000_000)),
                                           ("2GiB", Budget(nbytes=2 << 30)), ("123", Budget(nbytes=123)),
                                           (None, Budget())])
def test_budget_parse(text, expected):
    assert Budget.parse(text) == expected


@pytest.mark.parametrize("text", ["0", "0%", "-5%", "0.5", "-5", "150%", "nan%", "x"])
def test_budget_refuses(text):
    with pytest.raises(ValueError, match="--expert-budget"):
        Budget.parse(text)


def test_run_options_decorator_adds_the_shared_flags_once():
    seen = {}

    @run_options("model", "sampling")
    def cmd(port: int = 8080, *, opts: RunOptions) -> None:
        seen.update(port=port, opts=opts)

    params = inspect.signature(cmd).parameters
    assert "opts" not in params and "port" in params and "temp" in params and "no_sd" not in params
    app = typer.Typer()
    app.command()(cmd)
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["--port", "1", "--temp", "0", "--seed", "5", "-t", "-1", "--draft-max", "3"])
    assert r.exit_code == 0, r.output
    opts = seen["opts"]
    assert seen["port"] == 1 and opts.temp == 0 and opts.seed == 5 and not opts.seed_random
    assert opts.threads == OPTIONS["threads"].default and opts.config.gamma == 3
    assert opts.pool == (PoolDevice(None, Budget()),)


def test_a_flag_declared_once_reaches_the_command_the_options_and_the_session_config():
    """--spec-draft-n-min is declared once, on SessionConfig.gamma_min (orchestrator/option.py):
    the typer command has it (both names), RunOptions carries it checked, SessionConfig takes it."""
    from orchestrator.decoding.speculative import SessionConfig
    from orchestrator.option import declared

    assert "gamma_min" in {name for name, _, _ in declared(SessionConfig)} and "gamma_min" in OPTIONS
    seen = {}

    @run_options("model")
    def cmd(*, opts: RunOptions) -> None:
        seen["opts"] = opts

    app = typer.Typer()
    app.command()(cmd)
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["--help"])
    assert "--spec-draft-n-min" in r.output and "--draft-min" in r.output
    r = CliRunner().invoke(app, ["--draft-min", "2", "--spec-draft-n-max", "5"])
    assert r.exit_code == 0, r.output
    assert seen["opts"].config.gamma_min == 2 and seen["opts"].config.gamma == 5
    r = CliRunner().invoke(app, ["--spec-draft-n-min", "-1"])
    assert r.exit_code == 2 and "--spec-draft-n-min/--draft-min must be >= 0" in r.output + str(r.stderr_bytes or b"")
    assert RunOptions.of(gamma_min=1).replace(gamma_min=3).config.gamma_min == 3


OFFLOAD_CHECK = """
import sys
from pathlib import Path
import numpy as np
from orchestrator.runtime.rpc import rpc_device
from engine_common import model_config, run_sequence
from orchestrator.gguf_files.gguf_export import make_random_model
from orchestrator.runtime.llm import Context, Model
from orchestrator.decoding.speculative import Session, SessionConfig
from orchestrator.runtime.pool import Budget, PoolDevice

path = make_random_model(Path(sys.argv[1]) / "m.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
with rpc_device() as dev:
    logits = {}
    for ngl in (0, 99):
        m = Model(path, n_gpu_layers=ngl)
        c = Context(m, n_ctx=64, n_batch=16, n_threads=1)
        logits[ngl] = run_sequence(c)
        c.close(); m.close()
    np.testing.assert_allclose(logits[99], logits[0], rtol=1e-4, atol=1e-4 * np.abs(logits[0]).max())
    texts = []
    for ngl, engine in ((0, False), (99, True)):
        cfg = SessionConfig(model=path, n_ctx=128, n_threads=1, n_gpu_layers=ngl, expert_engine=engine,
                            pool=(PoolDevice(dev, Budget(ratio=0.5)),), calibration_cache=Path(sys.argv[1]) / "cal.json")
        with Session(cfg) as s:
            texts.append(s.complete([5, 17, 42, 99], max_tokens=16).tokens)
            assert (s.engine is not None) == engine
    assert texts[0] == texts[1], texts
print("offload check passed")
"""


def test_offloaded_layers_keep_their_experts_on_the_host(tmp_path):
    """-ngl on a real second device (ggml RPC on 127.0.0.1): the non-expert weights move, the
    routed experts stay in host RAM (llama.cpp's --cpu-moe override), the logits do not change,
    and the expert pool on that device decodes the same tokens as no pool at all."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": f"{root}:{root / 'tests'}", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", OFFLOAD_CHECK, str(tmp_path)], capture_output=True, text=True,
                         timeout=600, cwd=root / "tests", env=env)
    assert "offload check passed" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


# QWEN with one slot group: streamed prefill stages two layers of experts (2 x 128 x 2.75 MiB)
STAGED = ModelSizes(**{**QWEN.__dict__, "staging_bytes": 2 * QWEN.expert_bytes // 48})


def test_the_staging_slots_of_streamed_prefill_come_before_the_pool():
    gpu = GPU("CUDA0", free=12 * GiB, total=12 * GiB)
    used = QWEN.non_expert_bytes + QWEN.kv_bytes_per_token * 4096
    p = place(STAGED, 4096, gpu, None, Budget())
    assert p.stream_prefill and p.pool[0].budget.nbytes == 12 * GiB - used - MARGIN - STAGED.staging_bytes
    assert "staging slots for streamed prefill" in p.note
    # --stream-prefill off: nothing set aside
    off = place(STAGED, 4096, gpu, None, Budget(), stream=False)
    assert off.pool[0].budget.nbytes == 12 * GiB - used - MARGIN and "staging" not in off.note


def test_streamed_prefill_gives_way_to_a_pool_with_no_room_beside_it():
    used = QWEN.non_expert_bytes + QWEN.kv_bytes_per_token * 4096
    # room for one slot per layer, not for that and the staging slots: the pool keeps it
    tight = GPU("CUDA0", free=used + MARGIN + STAGED.one_expert * 48 + STAGED.staging_bytes // 2, total=8 * GiB)
    p = place(STAGED, 4096, tight, None, Budget())
    assert p.device == "CUDA0" and not p.stream_prefill and p.pool[0].budget.nbytes >= STAGED.one_expert * 48
    assert "streamed prefill off" in p.note and "--stream-prefill off" in p.note
    # an explicit budget that fills the room: said once, in the placement's note
    gpu = GPU("CUDA0", free=12 * GiB, total=12 * GiB)
    left = 12 * GiB - used - MARGIN
    q = place(STAGED, 4096, gpu, None, Budget(nbytes=left - STAGED.staging_bytes // 2))
    assert not q.stream_prefill and "streamed prefill off" in q.note
    assert place(STAGED, 4096, gpu, None, Budget(nbytes=left - STAGED.staging_bytes)).stream_prefill


def test_model_sizes_count_the_staging_slots_of_each_slot_group():
    from orchestrator.shipped_models import default_model

    s = model_sizes(default_model("target"))  # one group: every MoE layer alike
    assert s.staging_bytes == 2 * s.expert_bytes // s.n_layer


def test_a_session_on_a_gpu_without_room_for_staging_streams_nothing_and_says_why(monkeypatch):
    """Through the options: the header line says streamed prefill is off and the session's stream
    mode is off; an explicit --stream-prefill ahead is refused with exit 2 instead."""
    import orchestrator.cli.setup as setup_module  # the placement's inputs, as session_setup sees them
    from orchestrator.cli.options import RunOptions
    from orchestrator.cli.setup import session_setup
    from orchestrator.shipped_models import default_model

    target = default_model("target")
    s = model_sizes(target)
    used = s.non_expert_bytes + s.kv_bytes_per_token * 512
    # a "GPU" with room for a pool of one slot per layer and half the staging slots
    gpu = GPU("CUDA0", free=used + MARGIN + s.one_expert * s.n_layer + s.staging_bytes // 2, total=8 * GiB)
    monkeypatch.setattr(setup_module, "first_gpu", lambda: gpu)
    setup = session_setup(RunOptions.of(model=target, n_ctx=512))
    assert setup.config.stream_prefill == "off" and setup.config.pool[0].name == "CUDA0"
    assert any("streamed prefill off" in n for n in setup.notes)
    with pytest.raises(typer.Exit) as e:
        session_setup(RunOptions.of(model=target, n_ctx=512, stream_prefill="ahead"))
    assert e.value.exit_code == 2


# ----------------------------------------------------------------------------- several devices

def test_layer_split_is_llama_cpps():
    """Offloaded layer i goes to the first device whose cumulative share of free memory exceeds
    i / (n + 1), the output layer being the n+1st: what llama.cpp did with two equal RPC servers
    (6 layers: 0..3 and 4..5; 4 layers: 0..2 and 3), and uneven devices take layers in proportion."""
    assert layer_split(6, [1, 1]) == [4, 2]
    assert layer_split(4, [1, 1]) == [3, 1]
    assert layer_split(48, [24 * GiB, 24 * GiB]) == [25, 23]
    assert layer_split(48, [24 * GiB, 12 * GiB]) == [33, 15]
    assert layer_split(48, [1, 0]) == [48, 0]


def test_two_devices_each_pool_the_experts_of_their_own_layers():
    a, b = GPU("CUDA0", 24 * GiB, 24 * GiB), GPU("CUDA1", 24 * GiB, 24 * GiB)
    p = place_several(QWEN, 4096, [a, b], [Budget()])
    per_layer = (QWEN.non_expert_bytes + QWEN.kv_bytes_per_token * 4096) / 48
    assert p.device == "CUDA0" and [d.name for d in p.pool[1:]] == ["CUDA1"] and p.n_gpu_layers == 48
    # each device: its layers' share of the experts, all of which fit in 24 GiB
    assert p.pool[0].budget.nbytes == QWEN.expert_bytes * 25 // 48 and p.pool[1].budget.nbytes == QWEN.expert_bytes * 23 // 48
    assert "CUDA0: layers 0..24" in p.note and "CUDA1: layers 25..47" in p.note and "100% of its experts" in p.note
    # two 8 GiB cards: each pool is what its card has left after its layers, the staging slots and the margin
    a, b = GPU("CUDA0", 8 * GiB, 8 * GiB), GPU("CUDA1", 8 * GiB, 8 * GiB)
    p = place_several(QWEN, 4096, [a, b], [Budget()])
    assert p.pool[0].budget.nbytes == int(8 * GiB - per_layer * 25 - MARGIN) - QWEN.staging_bytes
    assert p.stream_prefill


def test_uneven_devices():
    """A 24 GiB card beside an 8 GiB one: the bigger takes three quarters of the layers and a pool
    to match; a byte budget per device; a percentage is of the device's own layers' experts."""
    big, small = GPU("CUDA0", 24 * GiB, 24 * GiB), GPU("CUDA1", 8 * GiB, 8 * GiB)
    p = place_several(QWEN, 4096, [big, small], [Budget()])
    n_big = layer_split(48, [24 * GiB, 8 * GiB])[0]
    assert n_big == 37 and f"CUDA0: layers 0..{n_big - 1}" in p.note and f"CUDA1: layers {n_big}..47" in p.note
    assert p.pool[0].budget.nbytes == QWEN.expert_bytes * n_big // 48  # every expert of its layers fits
    assert p.pool[1].budget.nbytes == QWEN.expert_bytes * (48 - n_big) // 48
    # a Qwen3-235B-A22B-like Q4_K model on a 24 and a 12 GiB card: neither holds its layers' experts,
    # each pool takes what its card has left
    big_model = ModelSizes(n_layer=94, expert_bytes=126 * GiB, non_expert_bytes=6 * GiB, kv_bytes_per_token=193536,
                           n_experts_total=94 * 128, staging_bytes=2 * 128 * (126 * GiB // (94 * 128)))
    p = place_several(big_model, 4096, [big, GPU("CUDA1", 12 * GiB, 12 * GiB)], [Budget()])
    per_layer = (big_model.non_expert_bytes + big_model.kv_bytes_per_token * 4096) / 94
    counts = layer_split(94, [24 * GiB, 12 * GiB])
    for pool, free, n in zip((p.pool[0].budget.nbytes, p.pool[1].budget.nbytes), (24 * GiB, 12 * GiB), counts):
        assert pool == int(free - per_layer * n - MARGIN) - big_model.staging_bytes
    p = place_several(QWEN, 4096, [big, small], [Budget(nbytes=10 * GiB), Budget(ratio=0.5)])
    assert (p.pool[0].budget.nbytes, p.pool[0].budget.ratio) == (10 * GiB, 0.0) and p.pool[1].budget.ratio == 0.5
    assert "CUDA1" in p.note and "50% of its experts" in p.note
    with pytest.raises(PlacementError, match="does not fit CUDA1"):
        place_several(QWEN, 4096, [big, small], [Budget(ratio=0.25), Budget(nbytes=8 * GiB)])
    with pytest.raises(PlacementError, match="3 values for 2 devices"):
        place_several(QWEN, 4096, [big, small], [Budget(ratio=0.25)] * 3)
    # a device llama.cpp's split leaves without a layer is an error naming it
    with pytest.raises(PlacementError, match="CUDA1.*no layer"):
        place_several(QWEN, 4096, [big, GPU("CUDA1", 1, 1)], [Budget(ratio=0.25)])


def test_partial_offload_gives_the_host_layers_to_the_first_pool():
    a, b = GPU("CUDA0", 24 * GiB, 24 * GiB), GPU("CUDA1", 24 * GiB, 24 * GiB)
    p = place_several(QWEN, 4096, [a, b], [Budget(ratio=0.25)], ngl="20")
    assert p.n_gpu_layers == 20 and "20/48 layers on 2 devices" in p.note
    assert "CUDA0: layers 0..38" in p.note and "CUDA1: layers 39..47" in p.note  # 28 host + 11, then 9


def test_pool_layer_ranges_follow_llama_cpps_placement():
    assert pool_layer_ranges(["RPC0"] * 6, ["RPC0"]) == [(0, 0)]  # one device: every layer
    assert pool_layer_ranges(["RPC0"] * 4 + ["RPC1"] * 2, ["RPC0", "RPC1"]) == [(0, 4), (4, 6)]
    # the host's layers come first and join the first device's pool
    assert pool_layer_ranges(["CPU"] * 2 + ["A"] * 2 + ["B"] * 2, ["A", "B"]) == [(0, 4), (4, 6)]
    # listed in another order than llama.cpp's split
    assert pool_layer_ranges(["A"] * 3 + ["B"] * 3, ["B", "A"]) == [(3, 6), (0, 3)]
    # a device whose layers are all dense (deepseek2's leading dense layer) has no pool
    assert pool_layer_ranges(["A", "B", "B"], ["A", "B"], moe_layers=[1, 2]) == [None, (1, 3)]
    with pytest.raises(PlacementError, match="--device C: llama.cpp placed no layer"):
        pool_layer_ranges(["A", "B"], ["A", "C"])
    with pytest.raises(PlacementError, match="not one contiguous range"):
        pool_layer_ranges(["A", "B", "A"], ["A", "B"])


def test_device_and_budget_lists_parse():
    opts = RunOptions.from_cli(device="RPC0, RPC1", expert_budget="25%,512M")
    assert [d.name for d in opts.pool] == ["RPC0", "RPC1"]
    assert [d.budget for d in opts.pool] == [Budget(ratio=0.25), Budget(nbytes=512 * 1000**2)]
    for device, budget, said in (("A,A", None, "distinct"), ("A,", None, "distinct"), ("A,CPU", None, "CPU"),
                                 ("A,B", "1%,2%,3%", "3 values for 2 device")):
        with pytest.raises(typer.Exit):
            RunOptions.from_cli(device=device, expert_budget=budget)


# ----------------------------------------------------------------------------- hybrid models

# a Qwen3.6-35B-A3B-like Q4_K model: 40 layers, 30 of them gated delta nets (no KV cache), 10
# full attention with 2 KV heads of 256; one sequence's recurrent state per delta-net layer:
# conv 3 · (4096 + 2 · 16 · 128) + delta net 128 · 4096 floats
STATE_PER_LAYER = 4 * (3 * (4096 + 2 * 16 * 128) + 128 * 4096)
QWEN36 = ModelSizes(n_layer=40, expert_bytes=int(18.9 * GiB), non_expert_bytes=int(1.6 * GiB),
                    kv_bytes_per_token=10 * 2 * 2 * 256 * 2, n_experts_total=40 * 256, n_ctx_train=262144,
                    state_bytes=30 * STATE_PER_LAYER)


def test_recurrent_states_are_the_contexts_llama_cpp_keeps():
    """The target's context: 1 + γ snapshots (n_rs_seq = γ) when it speculates; a pool draft's: two sequences."""
    from orchestrator.runtime.placement import recurrent_states

    assert recurrent_states(8, True) == 11 and recurrent_states(8, False) == 9 and recurrent_states(0, False) == 1


def test_a_hybrids_recurrent_state_comes_out_of_the_pool():
    gpu = GPU("CUDA0", free=16 * GiB, total=16 * GiB)
    plain = place(QWEN36, 4096, gpu, None, Budget())
    p = place(QWEN36, 4096, gpu, None, Budget(), states=11)
    assert p.pool[0].budget.nbytes == plain.pool[0].budget.nbytes - 10 * QWEN36.state_bytes == \
        16 * GiB - QWEN36.non_expert_bytes - QWEN36.kv_bytes_per_token * 4096 - 11 * QWEN36.state_bytes - MARGIN
    assert p.state_bytes == 11 * QWEN36.state_bytes
    assert "40/40 layers on CUDA0, recurrent state 691 MiB (11 × 63 MiB), expert pool" in p.note
    # partial offload: the host's layers keep their share; no GPU: all of it on the host
    part = place(QWEN36, 4096, gpu, None, Budget(ratio=0.25), ngl="20", states=9)
    assert "20/40 layers on CUDA0, recurrent state 283 MiB (9 × 63 MiB)" in part.note
    assert "recurrent state 63 MiB on the host (1 × 63 MiB)" in place(QWEN36, 4096, None, None, Budget()).note
    # a non-hybrid says nothing of it
    assert "recurrent" not in place(QWEN, 4096, gpu, None, Budget(), states=11).note
    # two devices: each counts the state of its own layers
    two = place_several(QWEN36, 4096, [gpu, GPU("CUDA1", 24 * GiB, 24 * GiB)], [Budget()], states=9)
    assert "CUDA0: layers 0..16, recurrent state 240 MiB" in two.note
    assert "CUDA1: layers 17..39, recurrent state 325 MiB" in two.note


def test_model_sizes_of_a_hybrid_count_kv_in_full_attention_layers_only(tmp_path):
    """A tiny qwen35moe file: layers 0-2 gated delta nets, layer 3 full attention. Its KV cache
    and recurrent state per sequence are what llama.cpp allocates (llama_kv_cache and
    llama_memory_recurrent's sizes in its log, checked on spac's real qwen35moe and qwen3next files)."""
    from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

    cfg = tiny_config("qwen35moe")
    s = model_sizes(make_random_model(tmp_path / "h.gguf", cfg))
    assert s.kv_bytes_per_token == 1 * 2 * cfg.n_head_kv * cfg.head_dim * 2  # one layer's F16 K and V
    d_inner = cfg.linear_v_heads * cfg.linear_head_dim
    n_embd_r = (cfg.conv_kernel - 1) * (d_inner + 2 * cfg.linear_k_heads * cfg.linear_head_dim)
    assert s.state_bytes == 3 * 4 * (n_embd_r + cfg.linear_head_dim * d_inner)
    assert model_sizes(make_random_model(tmp_path / "q.gguf", tiny_config("qwen3moe"))).state_bytes == 0


def test_model_sizes_leave_out_a_hybrids_mtp_layer(tmp_path):
    """A qwen35moe header with an MTP block (nextn_predict_layers 1, flagged not recurrent): like
    llama.cpp's filter_attn, neither KV nor state for it (the real qwen35moe-mtp file: 512 B of KV
    per token, one layer, as llama.cpp's log says)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(tmp_path / "h.gguf", "qwen35moe")
    w.add_block_count(5)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_nextn_predict_layers(1)
    w.add_array("qwen35moe.attention.recurrent_layers", [True, True, True, False, False])
    for add, v in ((w.add_ssm_conv_kernel, 4), (w.add_ssm_state_size, 64), (w.add_ssm_group_count, 2),
                   (w.add_ssm_time_step_rank, 4), (w.add_ssm_inner_size, 256)):
        add(v)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = model_sizes(tmp_path / "h.gguf")
    assert s.kv_bytes_per_token == 512 and s.state_bytes == 3 * 4 * (3 * (256 + 2 * 2 * 64) + 64 * 256) == 215040


def test_recurrent_layer_flags_win_over_the_interval():
    from orchestrator.runtime.placement import recurrent_layers

    keys = {"qwen35moe.attention.recurrent_layers": [True, False, True, True]}
    assert recurrent_layers(lambda k, d=None: keys.get(k, d), "qwen35moe", 4) == [True, False, True, True]
    keys = {"qwen3next.full_attention_interval": 2, "qwen3next.nextn_predict_layers": 1}
    assert recurrent_layers(lambda k, d=None: keys.get(k, d), "qwen3next", 5) == [True, False, True, False, False]
    assert recurrent_layers(lambda k, d=None: d, "qwen3moe", 2) == [False, False]


def test_dry_run_of_a_hybrid_counts_its_states(tmp_path, monkeypatch):
    """Through the options, as `spac generate --dry-run`: the target's γ snapshots and the pool
    draft's two states on the GPU; with the pool off (no GPU), no draft and one state."""
    import orchestrator.cli.setup as setup_module  # the placement's inputs, as session_setup sees them
    from orchestrator.cli.setup import session_setup
    from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

    path = make_random_model(tmp_path / "h.gguf", tiny_config("qwen35moe"))
    s = model_sizes(path)
    monkeypatch.setattr(setup_module, "first_gpu", lambda: GPU("CUDA0", 8 * GiB, 8 * GiB))
    monkeypatch.setattr(setup_module, "devices", lambda: [("CUDA0", 1, 8 * GiB, 8 * GiB)])
    setup = session_setup(RunOptions.of(model=path, n_ctx=512, gamma=6))
    assert setup.state_bytes == (1 + 6 + 2) * s.state_bytes and "recurrent state" in setup.notes[-1]
    assert session_setup(RunOptions.of(model=path, n_ctx=512, draft="none")).state_bytes == s.state_bytes
    monkeypatch.setattr(setup_module, "first_gpu", lambda: None)
    monkeypatch.setattr(setup_module, "devices", lambda: [])
    off = session_setup(RunOptions.of(model=path, n_ctx=512))
    assert off.config.draft.none and off.state_bytes == s.state_bytes and "on the host" in off.notes[-1]


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_dry_run_json_of_a_hybrid(tmp_path):
    """`spac generate --dry-run` on a hybrid file: the placement line and --json say the bytes of
    its recurrent states (the CPU test device: the pool draft's two and the target's 1 + γ)."""
    import json

    from typer.testing import CliRunner

    from orchestrator.cli.main import app
    from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

    path = make_random_model(tmp_path / "h.gguf", tiny_config("qwen35moe"))
    one = model_sizes(path).state_bytes
    res = CliRunner().invoke(app, ["generate", "--dry-run", "-m", str(path), "--device", "CPU", "--draft-max", "4"])
    assert res.exit_code == 0, res.output
    assert f"recurrent state {7 * one / 2**20:.2f} MiB on the host (7 × {one / 2**20:.2f} MiB)" in res.output
    res = CliRunner().invoke(app, ["generate", "--dry-run", "--json", "-m", str(path), "--device", "CPU"])
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["draft"] == "pool" and out["recurrent_state_bytes"] == (1 + 8 + 2) * one
