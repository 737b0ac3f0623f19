"""`spac sim` / `spac trace` sub-apps, as the main CLI mounts them (with the live `trace record`)."""

from __future__ import annotations

from typer.testing import CliRunner

from orchestrator.cli.main import app as spac

runner = CliRunner()


def invoke(*args):
    return runner.invoke(spac, [str(a) for a in args])


def test_profiles():
    r = invoke("sim", "profiles")
    assert r.exit_code == 0 and "rtx4090" in r.output and "qwen3-30b-a3b" in r.output


def test_run_writes_table_and_plot(tmp_path):
    r = invoke("sim", "run", "--steps", 6, "-p", "static", "-p", "moe-spac-paper", "-p", "spac", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    assert "moe-spac-paper" in r.output and (tmp_path / "policies.png").stat().st_size > 1000
    assert (tmp_path / "policies.json").exists()



def test_drafts_made_of_the_target(tmp_path):
    """--draft mtp / pool: the target's own MTP head or pool draft; a target without an MTP block
    is one error naming --draft (exit 2)."""
    r = invoke("sim", "run", "--steps", 6, "-p", "spac", "--model", "qwen3.6-35b-a3b", "--draft", "mtp", "--out", tmp_path)
    assert r.exit_code == 0 and "draft mtp" in r.output, r.output
    r = invoke("sim", "run", "--steps", 6, "-p", "spac", "--model", "qwen3-30b-a3b", "--draft", "mtp", "--out", tmp_path)
    assert r.exit_code == 2 and "--draft" in r.output and "no MTP block" in r.output, r.output

def test_trace_synth_info_and_replay(tmp_path):
    path = tmp_path / "olmoe.npz"
    r = invoke("trace", "synth", path, "--steps", 8, "--model", "olmoe-1b-7b", "--gamma", 4)
    assert r.exit_code == 0, r.output
    r = invoke("trace", "info", path)
    assert r.exit_code == 0 and "64" in r.output
    r = invoke("sim", "run", "--trace", path, "--model", "olmoe-1b-7b", "-p", "lru", "-p", "moe-speq")
    assert r.exit_code == 0 and "moe-speq" in r.output, r.output
    r = invoke("sim", "run", "--trace", path, "--model", "qwen3-30b-a3b", "-p", "lru")
    assert r.exit_code == 2 and "trace shape" in r.output


def test_bad_trace_and_record(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 truncated")
    r = invoke("trace", "info", bad)
    assert r.exit_code == 1 and "truncated or corrupt" in r.output
    r = invoke("trace", "record", tmp_path / "live.npz")  # no prompt
    assert r.exit_code == 2 and "--prompt" in r.output


def test_sweeps_and_ablation(tmp_path):
    common = ("--steps", 5, "--model", "olmoe-1b-7b")
    r = invoke("sim", "sweep-cache", *common, "-p", "static", "-p", "spac", "--ratios", "0.2,0.5", "--out", tmp_path)
    assert r.exit_code == 0 and (tmp_path / "cache_ratio.png").exists(), r.output
    r = invoke("sim", "sweep-k", *common, "--k-max", 3, "--out", tmp_path)
    assert r.exit_code == 0 and (tmp_path / "k.png").exists(), r.output
    r = invoke("sim", "ablation", *common)
    assert r.exit_code == 0 and "w/o SD" in r.output and "w/o SG-Evictor" in r.output, r.output
    r = invoke("sim", "accuracy", *common)
    assert r.exit_code == 0 and "previous step" in r.output, r.output
