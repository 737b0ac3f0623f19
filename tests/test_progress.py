"""runtime/progress.py: the loading phases on stderr (plain lines, the rich display), nothing from a
library's default reporter, and `spac generate --json` keeping stdout pure JSON."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.cli.setup import default_models
from orchestrator.runtime import progress
from orchestrator.runtime.llm import Model
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

runner = CliRunner()
SECONDS = r"\d+\.\d s"


@pytest.fixture(autouse=True)
def cold_caches(tmp_path, monkeypatch):
    """The host layout timing and the calibration measure again (their caches miss)."""
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))


def test_plain_reporter_prints_start_and_end_on_stderr(capsys):
    with progress.reporting(progress.PlainReporter(quiet_s=0)):
        with progress.phase("timing host layouts: Q4_0 experts"):
            pass
        for i in range(101):  # llama.cpp reports a fraction per tensor: a fast load is two lines
            progress.report_fraction("loading m.gguf", i / 100)
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert lines[0] == "spac: timing host layouts: Q4_0 experts ..."
    assert re.fullmatch(f"spac: timing host layouts: Q4_0 experts: {SECONDS}", lines[1])
    assert lines[2] == "spac: loading m.gguf ..."
    assert re.fullmatch(f"spac: loading m.gguf: {SECONDS}", lines[3])
    assert len(lines) == 4


def test_plain_reporter_shows_a_slow_phase_share_and_no_end_of_a_failed_one(capsys, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_MIN_GAP_S", 0.0)  # as if every step took a second
    with progress.reporting(progress.PlainReporter(quiet_s=0)):
        with progress.phase("calibrating", total=4) as calibrating:
            for _ in range(4):
                calibrating.advance()
        with pytest.raises(RuntimeError), progress.phase("timing host layouts: Q4_K experts"):
            raise RuntimeError("the error line says why")
        progress.report_fraction("loading broken.gguf", 0.0)  # the load fails: leaving `reporting` ends it
    lines = capsys.readouterr().err.splitlines()
    assert lines[:4] == ["spac: calibrating ...", *(f"spac: calibrating: {share}%" for share in (25, 50, 75))]
    assert re.fullmatch(f"spac: calibrating: {SECONDS}", lines[4])
    assert lines[5:] == ["spac: timing host layouts: Q4_K experts ...", "spac: loading broken.gguf ..."]
    assert progress._by_name == {}


def test_plain_reporter_says_nothing_of_a_quick_phase_and_starts_a_slow_one_on_time(capsys):
    """A warm start prints nothing (a bad file's error stays one line); a phase past the quiet
    time says it started while it still runs, not only when it ends."""
    import time

    with progress.reporting(progress.PlainReporter(quiet_s=0.2)):
        with progress.phase("loading quick.gguf"):
            pass
        assert capsys.readouterr().err == ""
        with progress.phase("timing host layouts: Q4_0 experts"):
            time.sleep(0.5)
            assert capsys.readouterr().err == "spac: timing host layouts: Q4_0 experts ...\n"
    assert re.fullmatch(f"spac: timing host layouts: Q4_0 experts: {SECONDS}\n", capsys.readouterr().err)


def test_default_reporter_prints_nothing(capfd, tmp_path):
    """A library user (no reporter installed) sees nothing, even while a cold load is timed."""
    path = make_random_model(tmp_path / "m.gguf", tiny_config("qwen3moe", n_layer=2, n_embd=64, n_expert=8,
                                                              n_expert_used=2, n_ff_exp=64), seed=1, quant="q4_0")
    capfd.readouterr()
    with progress.phase("calibrating", total=2) as calibrating:
        calibrating.advance(2)
    progress.report_fraction("loading m.gguf", 1.0)
    Model(path, repack="auto").close()
    out = capfd.readouterr()
    assert out.out == "" and out.err == ""


def test_stderr_reporter_by_console():
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(progress.on_stderr(terminal), progress.RichReporter)
    assert isinstance(progress.on_stderr(terminal, plain=True), progress.PlainReporter)  # --json
    assert isinstance(progress.on_stderr(Console(file=io.StringIO(), force_terminal=False)), progress.PlainReporter)


def test_rich_reporter_keeps_a_line_for_a_long_phase_only(monkeypatch):
    out = io.StringIO()
    reporter = progress.RichReporter(Console(file=out, force_terminal=True, width=100))
    with progress.reporting(reporter):
        for i in range(11):
            progress.report_fraction("loading fast.gguf", i / 10)
        monkeypatch.setattr(progress, "KEEP_LINE_S", 0.0)
        with progress.phase("calibrating", total=2) as calibrating:
            calibrating.advance(2)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())
    assert re.search(f"calibrating: {SECONDS}", text) and not re.search(f"loading fast.gguf: {SECONDS}", text)
    assert reporter._bar is None  # the display stopped with its last phase


@pytest.mark.skipif(default_models()[0] is None, reason="no shipped default models")
def test_generate_json_keeps_stdout_pure_and_says_what_it_loads(monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_QUIET_S", 0.0)  # the small model loads in well under the quiet time
    target, _ = default_models()
    r = runner.invoke(app, ["generate", "def f(", "-n", "8", "--json", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_tokens"] >= 1  # stdout is the one JSON object, nothing else
    lines = r.stderr.splitlines()
    assert f"spac: loading {target.name} ..." in lines
    assert any(re.fullmatch(f"spac: loading {re.escape(target.name)}: {SECONDS}", line) for line in lines)
    assert all(line.startswith("spac: ") for line in lines), r.stderr  # plain lines, no display
    # warm caches: the host layout timing (where this CPU has a layout to time) is not repeated and says nothing
    r = runner.invoke(app, ["generate", "def f(", "-n", "8", "--json", "-t", "1"])
    assert r.exit_code == 0 and json.loads(r.stdout)
    assert "timing host layouts" not in r.stderr and f"spac: loading {target.name} ..." in r.stderr
