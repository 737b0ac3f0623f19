"""`spac sim prefill`: the time-to-first-token model of the three prefill systems and its limit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.sim import profiles
from orchestrator.sim.prefill import SYSTEMS, UBATCHES, PrefillModel

MOE_MODELS = [k for k, m in profiles.model_profiles().items() if m.n_layer and not m.draft]


@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("hardware", list(profiles.hardware_profiles()))
def test_the_limit_bounds_every_device_prefill(hardware, model):
    """The limit is a lower bound on the time of every system that computes experts on the GPU,
    at every ubatch size, pool size and prompt length, skewed routing included."""
    hw, m = profiles.hardware(hardware), profiles.model(model)
    skewed = np.random.default_rng(0).pareto(1.0, (m.n_layer, m.n_expert)) + 0.01
    for popularity in (None, skewed):
        for ratio in (0.0, 0.17, 0.5, 1.0):
            pm = PrefillModel(hw, m, "Q4_K", ratio, popularity)
            for n in (65, 700, 2048, 8192):
                bound = pm.limit(n).ttft_s
                for u in UBATCHES:
                    for system in ("op-offload", "spac", "spac-used"):
                        assert bound <= pm.run(system, n, u).ttft_s * (1 + 1e-9), (system, ratio, n, u)


def test_spac_copies_the_nonresident_experts_once_per_ubatch():
    hw, m = profiles.hardware("rtx4090"), profiles.model("qwen3-30b-a3b")
    w_e = m.expert_bytes("Q4_K")
    pm = PrefillModel(hw, m, "Q4_K", cache_ratio=0.25)
    n_nonresident = m.n_layer * (m.n_expert - 32)
    assert pm.run("spac", 2048, 512).bytes_copied == pytest.approx(4 * n_nonresident * w_e)
    assert pm.run("op-offload", 2048, 512).bytes_copied == pytest.approx(4 * m.n_layer * m.n_expert * w_e)
    everything = PrefillModel(hw, m, "Q4_K", cache_ratio=1.0)
    assert everything.run("spac", 2048, 512).bytes_copied == 0.0
    assert everything.run("cpu", 2048, 512).bytes_copied == 0.0


def test_streaming_overlaps_the_copies_with_compute():
    """spac is faster than copying and computing in turn, and never slower than its copies alone."""
    hw, m = profiles.hardware("rtx4060"), profiles.model("qwen3-30b-a3b")
    pm = PrefillModel(hw, m, "Q4_K", cache_ratio=0.0)  # nothing resident: the same copies as op offload
    for n in (512, 2048):
        spac, serial = pm.run("spac", n, n), pm.run("op-offload", n, n)
        assert spac.bytes_copied == serial.bytes_copied
        assert spac.ttft_s < serial.ttft_s
        assert spac.ttft_s >= spac.bytes_copied / hw.pcie_bw
        assert 0.0 < spac.copy_hidden <= 1.0


def test_issue_targets_on_the_4090_profile():
    """At 2k tokens on the RTX 4090 profile (17% pool): ≥ 1.5× op offload, within 15% of the limit."""
    pm = PrefillModel(profiles.hardware("rtx4090"), profiles.model("qwen3-30b-a3b"), "Q4_K", 0.17)
    spac, offload, limit = (pm.best(s, 2048).ttft_s for s in ("spac", "op-offload", "limit"))
    assert offload / spac >= 1.5
    assert spac <= 1.15 * limit


def test_cli_json_rows():
    res = CliRunner().invoke(app, ["sim", "prefill", "--hardware", "rtx4090,rtx3060", "--prompt-tokens", "512,2048",
                                   "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) == 2 * 2 * len(SYSTEMS)
    assert {r["system"] for r in rows} == set(SYSTEMS)
    for r in rows:
        assert {"hardware", "prompt_tokens", "system", "ttft_s"} <= set(r) and r["simulated"] is True
        assert r["ttft_s"] > 0


def test_cli_table_and_bad_input():
    runner = CliRunner()
    res = runner.invoke(app, ["sim", "prefill", "--prompt-tokens", "2048"])
    assert res.exit_code == 0, res.output
    assert "SIMULATED" in res.output and "op-offload" in res.output and "limit" in res.output
    for args, flag in ((["--hardware", "nope"], "--hardware"), (["--hardware", "mine.toml"], "--hardware"),
                       (["--prompt-tokens", "many"], "--prompt-tokens"), (["--quant", "Q3"], "--quant"),
                       (["--cache-ratio", "2"], "--cache-ratio")):
        res = runner.invoke(app, ["sim", "prefill", *args])
        assert res.exit_code == 2, (args, res.output)
        assert flag in res.output
