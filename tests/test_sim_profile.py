"""`spac sim profile measure` writes a profile that loads, and the cost model it feeds orders
machines the right way round (a faster device predicts a faster run). No timing is asserted."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app as spac
from orchestrator.policies import make_policy
from orchestrator.sim import profiles
from orchestrator.sim.profiles import CostModel, MeasuredProfile, read_measured, write_measured
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import family_trace

runner = CliRunner()

# a made-up machine in the measured format (seconds per byte): host 10 GB/s, device 40 GB/s
MACHINE = MeasuredProfile(
    key="test", name="test machine", cpu="test cpu", device="RPC0", host_threads=1, vram_GB=8.0,
    host={"Q4_K": ((1, 2, 4), (1e-10, 1.1e-10, 1.5e-10))}, device_rates={"Q4_K": ((1, 4), (2.5e-11, 3e-11))},
    copy_bytes_per_s=5e9, copy_latency_s=20e-6, crossing_s=50e-6,
    non_expert_s_per_byte=2.5e-11, non_expert_s_per_byte_token=1e-12, draft_s_per_byte=1e-10)


def tokens_per_s(machine: MeasuredProfile, tmp_path, policy: str = "spac", ratio: float = 0.25, gamma: int = 4) -> float:
    path = write_measured(tmp_path / f"{policy}-{id(machine)}.toml", machine)
    trace = family_trace("gpt-oss-20b", 12, gamma=gamma, acceptance=0.8, seed=1)
    config = SimConfig(hardware=str(path), model="gpt-oss-20b", draft="qwen3-0.6b" if gamma else None, cache_ratio=ratio)
    return Simulator(trace, config).run(make_policy(policy)).tokens_per_s


def test_round_trip_and_cost_model(tmp_path):
    path = write_measured(tmp_path / "m.toml", MACHINE, comment="a test\nprofile")
    back = read_measured(path)
    assert replace(back, key="test") == MACHINE
    costs = CostModel.from_measured(back, profiles.model("olmoe-1b-7b"), quant="Q4_K")
    w = profiles.model("olmoe-1b-7b").expert_bytes("Q4_K")
    # a table, linear between its points and along the last segment beyond
    assert costs.cpu_expert_s(3) == pytest.approx(w * 1.3e-10) and costs.cpu_expert_s(6) == pytest.approx(w * 1.9e-10)
    assert costs.gpu_expert_s(1) == pytest.approx(w * 2.5e-11) and costs.gpu_expert_s(0) == 0
    assert costs.transfer_s == pytest.approx(20e-6 + w / 5e9)
    assert costs.dense_layer_time(9) > costs.dense_layer_time(1) and costs.sync_every_layer and costs.zero_slot
    # an unmeasured type takes the rate of the measured type nearest in bits per weight
    assert back.expert_rate("host", "Q4_0") == back.expert_rate("host", "Q4_K")
    # copies inside a pass: a plan's rate where the staging path was not measured, else its own
    assert costs.fetch_s == costs.transfer_s and costs.stage_batch_s == 0
    staged = read_measured(write_measured(tmp_path / "s.toml", replace(MACHINE, stage_bytes_per_s=2e10, stage_batch_s=3e-4)))
    assert (staged.stage_bytes_per_s, staged.stage_batch_s) == (2e10, 3e-4)
    costs = CostModel.from_measured(staged, profiles.model("olmoe-1b-7b"), quant="Q4_K")
    assert costs.fetch_s == pytest.approx(20e-6 + w / 2e10) and costs.transfer_s == pytest.approx(20e-6 + w / 5e9)
    assert costs.stage_batch_s == 3e-4


def test_the_mean_of_two_measurements():
    """bench_sim_truth.py measures the machine before and after its live rows and predicts with the
    mean: every rate, and each expert table point by point."""
    slower = replace(MACHINE, host={"Q4_K": ((1, 2, 4), (3e-10, 3.1e-10, 3.5e-10))}, crossing_s=150e-6,
                     copy_bytes_per_s=3e9, measured_at="later")
    mean = profiles.average_measured([MACHINE, slower])
    assert mean.host["Q4_K"] == ((1, 2, 4), pytest.approx((2e-10, 2.1e-10, 2.5e-10)))
    assert mean.device_rates == MACHINE.device_rates  # the same in both
    assert mean.crossing_s == pytest.approx(100e-6) and mean.copy_bytes_per_s == pytest.approx(4e9)
    assert mean.non_expert_s_per_byte == MACHINE.non_expert_s_per_byte and mean.device == "RPC0"
    # a staging path measured in one of them only: its values, not half of them
    staged = profiles.average_measured([MACHINE, replace(slower, stage_bytes_per_s=2e10, stage_batch_s=4e-4)])
    assert (staged.stage_bytes_per_s, staged.stage_batch_s) == (2e10, 4e-4)
    with pytest.raises(ValueError, match="other token counts"):
        profiles.average_measured([MACHINE, replace(MACHINE, device_rates={"Q4_K": ((1, 2), (1e-11, 1e-11))})])
    with pytest.raises(ValueError, match="different devices"):
        profiles.average_measured([MACHINE, replace(MACHINE, device="CPU")])


@pytest.mark.parametrize("policy", ["static", "spac"])
def test_faster_device_predicts_faster_run(tmp_path, policy):
    base = tokens_per_s(MACHINE, tmp_path, policy)
    fast = replace(MACHINE, device_rates={"Q4_K": ((1, 4), (1e-11, 1.2e-11))}, non_expert_s_per_byte=1e-11)
    slow_link = replace(MACHINE, crossing_s=5e-3)
    assert tokens_per_s(fast, tmp_path, policy) > base > tokens_per_s(slow_link, tmp_path, policy)


def test_attention_grows_with_the_recorded_context(tmp_path):
    """A profile with an attention term predicts a slower run for the same routing further into the
    context; a trace without positions, or a profile without the term, is unchanged by them."""
    attending = replace(MACHINE, kv_s_per_byte=1e-10, kv_s_per_byte_token=2e-10)
    assert read_measured(write_measured(tmp_path / "a.toml", attending)).kv_s_per_byte_token == 2e-10
    trace = family_trace("gpt-oss-20b", 12, gamma=4, acceptance=0.8, seed=1)

    def run(machine, position):
        at = None if position is None else np.full(trace.n_steps, position, dtype=np.int32)
        path = write_measured(tmp_path / f"{id(machine)}.toml", machine)
        config = SimConfig(hardware=str(path), model="gpt-oss-20b", draft="qwen3-0.6b", cache_ratio=0.25)
        return Simulator(replace(trace, position=at), config).run(make_policy("static")).tokens_per_s

    assert run(attending, 4000) < run(attending, 100) < run(attending, 0) == run(attending, None)
    assert run(MACHINE, 4000) == run(MACHINE, 0)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rtx]\nname = 'x'\n")
    with pytest.raises(ValueError, match="not a spac-measured-profile"):
        read_measured(bad)
    text = write_measured(tmp_path / "m.toml", MACHINE).read_text()
    bad.write_text(text.replace("[crossing]", "[crossings]"))
    with pytest.raises(ValueError, match="crossing"):
        read_measured(bad)
    bad.write_text(text.replace("tokens = [1, 2, 4]", "tokens = [2, 1, 4]"))
    with pytest.raises(ValueError, match="increasing"):
        read_measured(bad)


def test_sim_run_and_show_take_a_file(tmp_path):
    path = write_measured(tmp_path / "m.toml", MACHINE)
    r = runner.invoke(spac, ["sim", "run", "--hardware", str(path), "--model", "olmoe-1b-7b", "--draft", "qwen3-0.6b",
                             "--steps", "5", "-p", "static", "-p", "spac"])
    assert r.exit_code == 0 and "test machine" in r.output, r.output
    r = runner.invoke(spac, ["sim", "profile", "show", str(path)])
    assert r.exit_code == 0 and "crossing 0.05 ms" in r.output, r.output


def test_measure_writes_a_profile_that_loads(tmp_path):
    """A reduced measurement (CPU test device, the shipped tiny target and draft, one repeat)."""
    from orchestrator.shipped_models import MODELS_DIR
    from orchestrator.runtime.native import engine_built

    if not engine_built():
        pytest.skip("the patched llama.cpp is not built")
    out = tmp_path / "here.toml"
    r = runner.invoke(spac, ["sim", "profile", "measure", str(out), "--gguf", str(MODELS_DIR / "spac-tiny-moe-f16.gguf"),
                             "--device", "CPU", "-md", str(MODELS_DIR / "spac-tiny-moe-q4_0.gguf"), "--repeats", "1"])
    assert r.exit_code == 0, r.output
    p = read_measured(out)
    assert p.device == "CPU" and not p.overlap and p.draft_file == "spac-tiny-moe-q4_0.gguf"
    assert set(p.host) == set(p.device_rates) == {"F16"} and p.draft_s_per_token > 0
    assert {f"tokens_{n}_{k}_s" for n in (1, 2, 4, 9) for k in ("predicted", "measured")} <= set(p.check)
    assert p.stage_bytes_per_s > 0 and p.stage_batch_s >= 0  # the cache ablation's uploads were timed
    # the file drives the simulator like any profile
    target, quant = profiles.from_gguf(MODELS_DIR / "spac-tiny-moe-f16.gguf")
    costs = CostModel.from_measured(p, target, quant=quant)
    # measured times: only their form is checked (a one-repeat timing need not grow with the batch)
    assert costs.gpu_expert_s(1) >= 0 and all(costs.cpu_expert_s(n) > 0 for n in (1, 9))


def test_copies_inside_a_pass_take_the_staging_paths_costs(tmp_path):
    """Uploads on miss go the staging path (its rate and a cost per layer that copies), a plan's
    copies the copy worker's: llama.cpp's cache, which copies only inside passes, follows the
    first; static placement, which copies only by plan, does not change with it."""
    def run(machine, policy):
        return tokens_per_s(machine, tmp_path, policy, gamma=0)

    fast, batched = replace(MACHINE, stage_bytes_per_s=20e9), replace(MACHINE, stage_batch_s=1e-3)
    assert run(fast, "llama-moe-cache") > run(MACHINE, "llama-moe-cache") > run(batched, "llama-moe-cache")
    for other in (fast, batched):
        assert run(other, "static") == pytest.approx(run(MACHINE, "static"), rel=1e-12)


def test_measure_times_the_host_in_the_sessions_exact_mode(monkeypatch):
    """The passes are timed with batches of up to EXACT_ROWS tokens row by row, as a session in
    exact mode computes them (measured without it, a one-token split pass took 27 ms where a
    session's took 32), and the process's own setting is back after."""
    from orchestrator.cli import profile_measure
    from orchestrator.decoding.speculative import EXACT_ROWS
    from orchestrator.runtime import host_layout
    from orchestrator.runtime.native import engine_built

    if not engine_built():
        pytest.skip("the patched llama.cpp is not built")
    seen = []
    monkeypatch.setattr(profile_measure, "_measure", lambda *a: seen.append(host_layout.batch_invariant_rows()))
    before = host_layout.batch_invariant_rows()
    profile_measure.measure("m.gguf", None)
    profile_measure.measure("m.gguf", None, exact=False)
    assert seen == [EXACT_ROWS, 0] and host_layout.batch_invariant_rows() == before


def test_copies_on_the_device_thread_delay_passes(tmp_path):
    """An RPC server receives copies on its compute thread: spac's prefetches (autoregressive: no
    drafting to hide them behind) then delay the next pass; static placement copies nothing after
    its first fill and is not affected."""
    blocking = replace(MACHINE, copy_blocks_device=True)
    assert tokens_per_s(blocking, tmp_path, "spac", gamma=0) < tokens_per_s(MACHINE, tmp_path, "spac", gamma=0)
    assert tokens_per_s(blocking, tmp_path, "static", gamma=0) == pytest.approx(
        tokens_per_s(MACHINE, tmp_path, "static", gamma=0))


def test_copies_inside_a_pass_have_the_device_thread_to_themselves(tmp_path):
    """llama.cpp's cache uploads every miss inside the pass, which waits for it: on a device that
    copies on its compute thread those copies are not slowed to its idle time, as a plan's are
    (with that rule the simulator put the cache 39-94% below the engine on the RPC stand-in)."""
    blocking = replace(MACHINE, copy_blocks_device=True)
    for gamma in (0, 4):
        assert tokens_per_s(blocking, tmp_path, "llama-moe-cache", gamma=gamma) == pytest.approx(
            tokens_per_s(MACHINE, tmp_path, "llama-moe-cache", gamma=gamma), rel=1e-9)
