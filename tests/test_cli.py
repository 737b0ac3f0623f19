"""`spac` CLI: generate (text and --json), chat, bad model paths, Ctrl-C handling, default models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import _DOUBLE_CTRL_C_S, app
from orchestrator.cli.setup import default_models
from orchestrator.runtime.native import engine_built
from orchestrator.runtime.pool import Budget
from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

CFG = tiny_config("qwen3moe", n_layer=2, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=64)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-models")
    return (make_random_model(d / "target.gguf", CFG, seed=1),
            make_random_model(d / "draft.gguf", CFG, seed=1, quant="q8_0"))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))


runner = CliRunner()


@pytest.fixture(params=["no_engine", "engine"])
def engine_args(request):
    if request.param == "engine" and not engine_built():
        pytest.skip("native engine not built")
    # the CPU pool is the test device: without a GPU, the default run has no pool
    return ["--no-engine"] if request.param == "no_engine" else ["--engine", "--device", "CPU", "--expert-budget", "50%"]


def test_generate_json(models, engine_args):
    target, draft = models
    r = runner.invoke(app, ["generate", "def f(x):", "-m", str(target), "-md", str(draft), "-n", "16",
                            "--temp", "0", "--draft-max", "4", "-t", "1", "--json", *engine_args])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("text", "n_tokens", "tokens_per_s", "acceptance_rate", "device_share", "bytes_copied"):
        assert key in out
    assert 1 <= out["n_tokens"] <= 16 and out["mode"] == "speculative"
    assert isinstance(out["text"], str)
    # the generated ids, as llama-server's /completion returns them: an ending EOG token included
    from orchestrator.runtime.llm import Model

    m = Model(target, repack="off")
    try:
        assert len(out["tokens"]) == out["n_tokens"] and all(isinstance(t, int) for t in out["tokens"])
        assert m.detokenize([t for t in out["tokens"] if not m.is_eog(t)]) == out["text"]
    finally:
        m.close()
    assert out["engine"] == ("--engine" in engine_args)
    if out["engine"]:
        assert 0.0 <= out["device_share"] <= 1.0 and out["tau_histogram"]


def test_generate_text_and_ablations(models):
    target, draft = models
    r = runner.invoke(app, ["generate", "import os", "-m", str(target), "-md", str(draft), "-n", "8",
                            "--seed", "3", "-c", "256", "--no-sd", "--no-balancer", "--no-engine", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.stderr and "autoregressive" in r.stderr


@pytest.mark.parametrize("kind", ["missing", "not_gguf", "draft_missing"])
def test_bad_model_path_is_one_line_exit_2(models, tmp_path, kind):
    target, _ = models
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    args = {"missing": ["-m", str(tmp_path / "nope.gguf")],
            "not_gguf": ["-m", str(junk)],
            "draft_missing": ["-m", str(target), "-md", str(tmp_path / "nope.gguf")]}[kind]
    r = runner.invoke(app, ["generate", "hi", *args, "--no-engine"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spac: error:"), r.stderr
    assert "Traceback" not in r.output
    assert ("not a GGUF file" if kind == "not_gguf" else "not found") in lines[0]


def test_chat_session_until_eof(models):
    target, draft = models
    r = runner.invoke(app, ["chat", "-m", str(target), "-md", str(draft), "-n", "8", "--temp", "0", "--no-engine", "-t", "1"],
                      input="hello\n/reset\nsecond\n")
    assert r.exit_code == 0, r.output
    assert "bye" in r.stdout


def test_ctrl_c_returns_to_prompt_then_exits(models, tmp_path, engine_args):
    """First SIGINT stops a long answer and returns to the prompt; the second one, at the
    prompt, exits with code 0 after closing engine, contexts and models."""
    target, draft = models
    env = {**os.environ, "SPAC_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "chat", "-m", str(target), "-md", str(draft),
         "-n", "1000000", "-c", "60000", "--temp", "0", "-t", "1", *engine_args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out: list[str] = []  # stdout as it comes, one character at a time: the prompt ends no line
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(done, what: str) -> None:
        deadline = time.monotonic() + 120
        while not done("".join(out)):
            assert time.monotonic() < deadline and proc.poll() is None, f"waiting for {what}: " + "".join(out)
            time.sleep(0.01)

    def at_prompt(text: str) -> bool:  # `> ` is the last thing printed: the chat waits for a line
        return text.endswith("\n> ")

    try:
        wait_for(lambda text: "Ctrl-C stops" in text and at_prompt(text), "the prompt")
        asked = len("".join(out))
        proc.stdin.write("tell me\n")
        proc.stdin.flush()
        # generating (a million tokens would take minutes)
        wait_for(lambda text: len(text) > asked, "the answer's first line")
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        wait_for(lambda text: "| interrupted" in text[asked:] and at_prompt(text),
                 "the prompt after the stopped answer")
        assert proc.poll() is None, "first Ctrl-C must return to the prompt"
        # a Ctrl-C this soon after the one that stopped the answer is its double press and is
        # ignored (the chat's own window, which opened before the prompt was printed): let it pass
        time.sleep(_DOUBLE_CTRL_C_S + 0.1)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    text = "".join(out)
    assert rc == 0, text + proc.stderr.read()
    assert "interrupted" in text and "bye" in text


def test_default_models_from_manifest(tmp_path):
    assert default_models(tmp_path) == (None, None)
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"default_draft": "draft-q4_0", "files": [
        {"file": "target.gguf", "role": "target"},
        {"file": "draft-dense.gguf", "role": "draft-dense"},
        {"file": "draft-q4_0.gguf", "role": "draft-q4_0"}]}))
    assert default_models(tmp_path) == (tmp_path / "target.gguf", tmp_path / "draft-q4_0.gguf")


def test_no_model_arguments_use_the_manifest(models, tmp_path, monkeypatch):
    import shutil

    from orchestrator import shipped_models as shipped

    target, draft = models
    shutil.copy(target, tmp_path / "t.gguf")
    shutil.copy(draft, tmp_path / "d.gguf")
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"default_draft": "draft-q8_0", "files": [
        {"file": "t.gguf", "role": "target"}, {"file": "d.gguf", "role": "draft-q8_0"}]}))
    monkeypatch.setattr(shipped, "MODELS_DIR", tmp_path)
    r = runner.invoke(app, ["generate", "x = ", "-n", "8", "--json", "-t", "1", "--no-engine"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["model"] == str(tmp_path / "t.gguf") and out["draft"] == str(tmp_path / "d.gguf")
    # -m naming the shipped target without -md takes the shipped draft too
    r = runner.invoke(app, ["generate", "x = ", "-n", "4", "--json", "-t", "1", "--no-engine",
                            "-m", str(tmp_path / "t.gguf")])
    assert json.loads(r.stdout.strip().splitlines()[-1])["mode"] == "speculative"
    monkeypatch.setattr(shipped, "MODELS_DIR", tmp_path / "nothing")
    r = runner.invoke(app, ["generate", "x = ", "--no-engine"])
    assert r.exit_code == 2 and "no shipped default models" in r.stderr


def test_generate_with_no_model_arguments():
    r = runner.invoke(app, ["generate", "def fibonacci(n):", "-n", "8", "--json", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["n_tokens"] >= 1


def test_parse_budget():
    assert Budget.parse("25%") == Budget(0, 0.25)
    assert Budget.parse("512M") == Budget(512_000_000, 0.0)
    assert Budget.parse("2GiB") == Budget(2 << 30, 0.0)
    assert Budget.parse("123") == Budget(123, 0.0)


def _fake_sysfs(root: Path, siblings: list[str], performance: str | None = None) -> Path:
    for cpu, mask in enumerate(siblings):
        topo = root / f"system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings").write_text(mask + "\n")
    if performance is not None:
        (root / "cpu_core").mkdir()
        (root / "cpu_core" / "cpus").write_text(performance + "\n")
    return root


def test_default_threads_are_the_physical_cores_as_llama_cpp(tmp_path):
    from orchestrator.cli.options import default_threads

    # 4 cores with 2 hardware threads each (siblings 0+4, 1+5, ...): 4 threads
    assert default_threads(_fake_sysfs(tmp_path / "smt", ["11", "22", "44", "88"] * 2)) == 4
    # hybrid: CPUs 0-3 are two performance cores with 2 threads each, 4-7 efficiency cores: 2
    assert default_threads(_fake_sysfs(tmp_path / "hybrid", ["03", "03", "0c", "0c", "10", "20", "40", "80"],
                                       performance="0-3")) == 2
    # no sysfs: psutil's physical cores
    assert default_threads(tmp_path / "none") >= 1
