"""What a new user hits in the first ten minutes (issue 16), each case run as a user would:
`python -m orchestrator.cli ...` in a subprocess from the repository root, on the shipped tiny
models. Bad input is one line `spac: error: ...` naming the flag or file, exit code 2; Ctrl-C is
`stop: interrupted`, exit code 130; nothing the user owns is overwritten."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.runtime.native import engine_built
from orchestrator.shipped_models import MODELS_DIR, default_model, sha256_file

ROOT = Path(__file__).resolve().parent.parent
TARGET = default_model("target")
DENSE = MODELS_DIR / "spac-tiny-dense-draft-f16.gguf"
FAST = ["-t", "1", "-n", "4"]


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")


def spac(*args, stdin: bytes | str | None = None, stdout=subprocess.PIPE, timeout: float = 120,
         python_code: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI like a user. python_code: run this instead of `-m orchestrator.cli` (a case
    that must change the interpreter first, e.g. hide matplotlib), argv still being args."""
    cmd = [sys.executable, "-m", "orchestrator.cli", *args] if python_code is None else \
        [sys.executable, "-c", python_code, *args]
    res = subprocess.run(cmd, cwd=ROOT, input=stdin.encode() if isinstance(stdin, str) else stdin,
                         stdout=stdout, stderr=subprocess.PIPE, timeout=timeout,
                         stdin=None if stdin is not None else subprocess.DEVNULL)
    res.out = res.stdout.decode(errors="replace") if res.stdout else ""
    res.err = res.stderr.decode(errors="replace")
    return res


def assert_usage_error(res, *words: str) -> None:
    """Exit 2 and one line `spac: error: ...` holding every word, no traceback."""
    assert res.returncode == 2, (res.returncode, res.out, res.err)
    lines = [ln for ln in res.err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in res.err and lines[-1].startswith("spac: error:"), res.err
    assert len([ln for ln in lines if ln.startswith("spac: error:")]) == 1, res.err
    for w in words:
        assert w in lines[-1], (w, lines[-1])


def last_json(res) -> dict:
    return json.loads(res.out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- data loss

@pytest.fixture
def source(tmp_path) -> Path:
    p = tmp_path / "src.gguf"
    shutil.copy(TARGET, p)
    return p


def test_draft_quantized_refuses_to_overwrite_its_source(source):
    before = sha256_file(source)
    for args in ([str(source), str(source)], [str(source), str(source.parent / "." / source.name), "--force"]):
        assert_usage_error(spac("draft", "quantized", *args), "is the input file")
        assert sha256_file(source) == before


def test_draft_output_exists_needs_force(source, tmp_path):
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"precious")
    assert_usage_error(spac("draft", "quantized", str(source), str(mine)), "exists", "--force")
    assert mine.read_bytes() == b"precious"
    res = spac("draft", "quantized", str(source), str(mine), "--force")
    assert res.returncode == 0, res.err
    assert mine.read_bytes()[:4] == b"GGUF"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_draft_missing_or_corrupt_source(tmp_path):
    assert_usage_error(spac("draft", "quantized", str(tmp_path / "nope.gguf"), str(tmp_path / "o.gguf")),
                       "not found", "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    assert_usage_error(spac("draft", "quantized", str(bad), str(tmp_path / "o.gguf")), "bad.gguf")
    assert not (tmp_path / "o.gguf").exists()


# ----------------------------------------------------------------------------- Python 3.10

@pytest.mark.parametrize("name", ["LOCK", "IK_LOCK"])
def test_build_script_reads_its_lock_without_tomllib(name):
    import build_native  # scripts/ is on pytest's pythonpath
    path = getattr(build_native, name)
    lock = build_native.read_lock(path)
    assert lock["version"] and len(lock["sha256"]) == 64
    if sys.version_info >= (3, 11):
        import tomllib

        assert lock == tomllib.loads(path.read_text())


def test_no_module_needs_python_311():
    """tomllib only behind a version check; nothing else of 3.11+ (the CI also runs 3.10)."""
    for path in [*ROOT.glob("orchestrator/**/*.py"), *ROOT.glob("scripts/*.py")]:
        text = path.read_text()
        for name in ("typing import Self", "ExceptionGroup", "datetime.UTC", "StrEnum", "except*"):
            assert name not in text, (path, name)
        if "import tomllib" in text:
            assert "sys.version_info >= (3, 11)" in text, path


# ----------------------------------------------------------------------------- prompts

def test_empty_and_missing_prompt():
    assert_usage_error(spac("generate", "", *FAST), "empty prompt")
    assert_usage_error(spac("generate", *FAST), "no prompt")


@pytest.mark.parametrize("prompt", [b"caf\xe9 = 1", b"\xff\xfe bad bytes", "café".encode()])
def test_prompt_bytes_from_any_locale(prompt):
    res = spac("generate", prompt, *FAST, "--json")
    assert res.returncode == 0, res.err
    assert last_json(res)["n_tokens"] >= 1


def test_prompt_from_p_f_and_stdin(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("def fibonacci(n):")
    args = [*FAST, "--temp", "0", "--json"]
    texts = {last_json(spac("generate", "def fibonacci(n):", *args))["text"],
             last_json(spac("generate", "-p", "def fibonacci(n):", *args))["text"],
             last_json(spac("generate", "-f", str(f), *args))["text"],
             last_json(spac("generate", "-", *args, stdin="def fibonacci(n):"))["text"]}
    assert len(texts) == 1
    assert_usage_error(spac("generate", "-f", str(tmp_path / "none.txt"), *FAST), "-f/--file", "none.txt")
    assert_usage_error(spac("generate", "x", "-p", "y", *FAST), "once")


# ----------------------------------------------------------------------------- numbers and flags

@pytest.mark.parametrize("budget", ["0", "0%", "-5%", "0.5", "-5", "150%", "lots"])
def test_expert_budget_strict(budget):
    assert_usage_error(spac("generate", "x", *FAST, f"--expert-budget={budget}", "--device", "CPU"), "--expert-budget")


def test_pin_mapping_needs_a_mapping():
    assert_usage_error(spac("generate", "x", *FAST, "--pin-mapping", "--no-mmap"), "--pin-mapping", "--no-mmap")


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_expert_budget_beyond_the_model_says_so():
    res = spac("generate", "x", *FAST, "--expert-budget", "999GiB", "--device", "CPU")
    assert res.returncode == 0, res.err
    assert "every expert" in res.err and "999" not in res.out


def test_unknown_device():
    assert_usage_error(spac("generate", "x", *FAST, "--device", "CUDA7"), "--device CUDA7", "no such device")


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_zero_or_negative_mean_the_default(threads):
    res = spac("generate", "x", "-n", "4", "-t", threads, "--json")
    assert res.returncode == 0, res.err
    assert last_json(res)["n_threads"] >= 1


def test_ubatch_auto_or_a_number():
    """-ub auto (the default) is llama.cpp's 512 without a streamed prefill; a number is kept."""
    assert last_json(spac("generate", "x", *FAST, "--json"))["n_ubatch"] == 512
    assert last_json(spac("generate", "x", *FAST, "-ub", "64", "--json"))["n_ubatch"] == 64


def test_n_predict_minus_one_is_no_limit():
    res = spac("generate", "x", "-t", "1", "-n", "-1", "-c", "48", "--temp", "0", "--json")
    out = last_json(res)
    assert res.returncode == 0 and out["stop_reason"] in ("context", "eos") and out["n_tokens"] > 4, res.err
    assert_usage_error(spac("generate", "x", "-t", "1", "-n", "-3"), "-n/--n-predict")


def test_draft_max_zero_means_no_draft_and_upstream_name_accepted():
    res = spac("generate", "x", *FAST, "--draft-max", "0")
    assert res.returncode == 0 and "autoregressive" in res.err and "draft spac" not in res.err, res.err
    out = last_json(spac("generate", "x", *FAST, "--spec-draft-n-max", "3", "--json"))
    assert out["gamma"] == 3 and out["mode"] == "speculative"
    assert_usage_error(spac("generate", "x", *FAST, "--draft-max", "-1"), "--spec-draft-n-max")


@pytest.mark.parametrize("flag,value", [("--temp", "nan"), ("--temp", "inf"), ("--top-p", "nan"), ("-c", "-1"),
                                        ("-ngl", "lots"), ("-ub", "0"), ("-ub", "lots"),
                                        ("--stream-prefill", "sideways")])
def test_nonsense_numbers(flag, value):
    assert_usage_error(spac("generate", "x", *FAST, flag, value), flag)


def test_help_keeps_its_defaults():
    res = spac("generate", "--help")
    assert res.returncode == 0
    text = " ".join(res.out.split())
    assert "[default: the shipped model, orchestrator/shipped_models/MANIFEST.json]" in text.replace("│ ", "")
    assert "--spec-draft-n-max" in text and "--draft-max" in text
    assert "[default: on when built" in text.replace("│ ", "")


# ----------------------------------------------------------------------------- models

def test_copy_of_the_shipped_target_finds_its_draft(tmp_path):
    copy = tmp_path / "my-model.gguf"
    shutil.copy(TARGET, copy)
    out = last_json(spac("generate", "x", *FAST, "-m", str(copy), "--json"))
    assert out["draft"] == str(default_model("draft")) and out["mode"] == "speculative"


def test_other_target_says_why_there_is_no_draft():
    res = spac("generate", "x", *FAST, "-m", str(DENSE))
    assert res.returncode == 0, res.err
    header = res.err.splitlines()[0]
    assert "no draft (-md" in header and "dense (no routed experts)" in header, header


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> Path:
    import gguf

    path = tmp_path_factory.mktemp("nan") / "nan.gguf"
    shutil.copy(TARGET, path)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    with open(path, "r+b") as f:
        f.seek(t.data_offset)
        f.write(np.full(256, np.nan, np.float16).tobytes())
    return path


def test_check_tensors_names_the_nan_tensor(nan_model):
    assert_usage_error(spac("generate", "x", *FAST, "-m", str(nan_model), "--check-tensors"),
                       "blk.0.attn_q.weight", "invalid data")


def test_nan_output_is_an_error_not_garbage(nan_model):
    assert_usage_error(spac("generate", "x", *FAST, "-m", str(nan_model), "--temp", "0"), "NaN", "--check-tensors")


def test_load_errors_go_to_stderr_not_stdout(tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray(TARGET.read_bytes()[:4096])  # a valid header, no tensor data
    bad.write_bytes(bytes(data))
    res = spac("generate", "x", *FAST, "-m", str(bad), "--json")
    assert res.returncode == 2 and res.out == "", (res.out, res.err)
    assert "bad.gguf" in res.err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- output

def test_full_disk_is_one_line():
    with open("/dev/full", "wb") as full:
        for extra in ([], ["--json"]):
            res = spac("generate", "x", *FAST, *extra, stdout=full)
            assert_usage_error(res, "standard output", "No space left")


def test_sim_out_without_matplotlib_keeps_the_data(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from orchestrator.cli.main import main; "
            "sys.argv[0] = 'spac'; main()")
    res = spac("sim", "run", "--steps", "5", "-p", "lru", "--out", str(tmp_path), python_code=code)
    assert res.returncode == 0, res.err
    assert (tmp_path / "policies.json").exists() and "matplotlib is not installed" in res.err


# ----------------------------------------------------------------------------- defaults and --json

def test_no_gpu_pool_off_in_one_line_and_json_says_why():
    res = spac("generate", "x", *FAST, "--json", "--seed", "7")
    out = last_json(res)
    assert out["engine"] is False and "no GPU" in out["pool_off_reason"]
    assert out["seed"] == 7 and out["gamma"] == 8 and out["n_slots"] == 0 and "budget_bytes" in out
    res = spac("generate", "x", *FAST)
    assert "expert pool off: no GPU found" in res.err.splitlines()[0]
    random_seed = last_json(spac("generate", "x", *FAST, "--json"))
    assert random_seed["seed_random"] and random_seed["seed"] >= 0


def test_dry_run_prints_the_placement():
    res = spac("generate", "--dry-run", "--json")
    out = last_json(res)
    assert res.returncode == 0 and out["pool_device"] is None and "no GPU" in out["pool_off_reason"]


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_cpu_test_device_json_reports_the_pool():
    out = last_json(spac("generate", "x", *FAST, "--json", "--device", "CPU", "--expert-budget", "50%"))
    assert out["engine"] and out["pool_device"] == "CPU" and out["n_slots"] > 0 and out["budget_ratio"] == 0.5
    assert_usage_error(spac("generate", "x", *FAST, "--engine"), "--engine", "no GPU")


# ----------------------------------------------------------------------------- interrupts

class _Run:
    """The CLI in a subprocess, as `spac` would be run (or python_code, as in `spac`); its stdout
    and stderr collected as they come, one character at a time, into `out` and `err`."""

    def __init__(self, *args: str, python_code: str | None = None) -> None:
        cmd = [sys.executable, "-m", "orchestrator.cli", *args] if python_code is None else \
            [sys.executable, "-c", python_code, *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=lambda f=f, into=into: into.extend(iter(lambda: f.read(1), "")),
                                          daemon=True) for f, into in ((self.proc.stdout, self.out),
                                                                       (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    def text(self) -> str:
        return "".join(self.out)

    def wait_for(self, done, what: str, seconds: float = 120, stream: str = "out") -> None:
        """Until done(the stream's text so far) (done: a function, or a text it must hold); fails
        naming `what` if the process ends first or `seconds` pass."""
        test = done if callable(done) else (lambda text: done in text)
        chars = self.out if stream == "out" else self.err
        deadline = time.monotonic() + seconds
        while not test("".join(chars)):
            rc = self.proc.poll()
            if rc is not None or time.monotonic() > deadline:
                why = f"it exited with {rc}" if rc is not None else f"not within {seconds} s"
                pytest.fail(f"waiting for {what}: {why}\nstdout: {self.text()[-2000:]}\n"
                            f"stderr: {''.join(self.err)[-2000:]}")
            time.sleep(0.01)

    def write(self, line: str) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def finish(self, timeout: float = 30) -> int:
        """The exit code, once the process has ended and all of its output is read."""
        printed = len(self.out)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"not ended within {timeout} s; it printed {len(self.out) - printed} characters more "
                        f"meanwhile\nstdout: {self.text()[-500:]}\nstderr: {''.join(self.err)[-2000:]}")
        for reader in self._readers:
            reader.join(timeout)  # end of file once the process is gone
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


# `--json` prints nothing until the end: `Session.on_verify_step`, the hook the server uses, prints
# this line on stderr once the first verification step is done, so a Ctrl-C after it lands in the
# generation loop (not in the loading, whose Ctrl-C is another case)
_GENERATING = "spac-test: generating"
def _after_first_step(body: str) -> str:
    """A program that runs the CLI (with the arguments after it, as `spac` would) and runs `body`
    (statements) once, after the first verification step, from `Session.on_verify_step`."""
    return ("import os, signal, sys\nfrom orchestrator.decoding.speculative import Session\n"
            "def once():\n" + textwrap.indent(body, "    ") + "\n"
            "init = Session.__init__\n"
            "def hooked(self, *a, **k):\n    init(self, *a, **k)\n    said = []\n"
            "    def first_step(seconds):\n        if not said:\n            said.append(1)\n            once()\n"
            "    self.on_verify_step = first_step\n"
            "Session.__init__ = hooked\n"
            "from orchestrator.cli.main import main; sys.argv[0] = 'spac'; main()")


_SAY_WHEN_GENERATING = _after_first_step(f"print({_GENERATING!r}, file=sys.stderr, flush=True)")


def _at_prompt(text: str) -> bool:
    """The chat's prompt `> ` is the last thing it printed: it waits for a line."""
    return text.endswith("\n> ")


@pytest.mark.parametrize("json_out", [False, True])
def test_ctrl_c_in_generate_says_interrupted_exit_130(json_out):
    args = ["generate", "x", "-t", "1", "-n", "-1", "-c", "100000", "--temp", "0"] + (["--json"] if json_out else [])
    run = _Run(*args, python_code=_SAY_WHEN_GENERATING if json_out else None)
    try:
        if json_out:
            run.wait_for(_GENERATING, "the first verification step", stream="err")
        else:
            run.wait_for("0", "the first generated text")  # streaming
        assert run.proc.poll() is None
        run.proc.send_signal(signal.SIGINT)
        rc = run.finish()
    finally:
        run.kill()
    err = "".join(run.err)
    assert rc == 130, err
    if json_out:
        assert json.loads(run.text().strip().splitlines()[-1])["stop_reason"] == "interrupted", err
    else:
        assert "stop: interrupted" in err


# Python's own SIGINT handler raises KeyboardInterrupt in whatever code runs when the signal is
# handled; in a finalizer (here a generator closed as it is dropped) the exception is printed and
# lost, and an endless generation went on. This hook sends the signal from one, after the first step
_CTRL_C_IN_A_FINALIZER = _after_first_step(
    "def finalized():\n    try:\n        yield\n    finally:\n"
    "        os.kill(os.getpid(), signal.SIGINT)\n        sum(range(10000))\n"
    "dropped = finalized()\nnext(dropped)\ndel dropped")


def test_ctrl_c_handled_in_a_finalizer_still_stops_the_generation():
    res = spac("generate", "x", "-t", "1", "-n", "-1", "-c", "100000", "--temp", "0", "--json",
               python_code=_CTRL_C_IN_A_FINALIZER, timeout=120)
    assert res.returncode == 130, res.err
    assert json.loads(res.out.strip().splitlines()[-1])["stop_reason"] == "interrupted", res.err


def test_ctrl_c_while_loading_is_never_lost():
    """SIGINT arriving while llama.cpp loads the model: the load is abandoned and the run ends
    with exit 130 (it used to be printed as 'Exception ignored ... KeyboardInterrupt' and lost)."""
    code = ("import os, signal, sys; import llama_cpp as L; load = L.llama_model_load_from_file\n"
            "def slow_load(*a):\n    os.kill(os.getpid(), signal.SIGINT); return load(*a)\n"
            "L.llama_model_load_from_file = slow_load\n"
            "from orchestrator.cli.main import main; sys.argv[0] = 'spac'; main()")
    res = spac("generate", "x", "-t", "1", "-n", "-1", python_code=code, timeout=60)
    assert res.returncode == 130, res.err
    assert "Exception ignored" not in res.err and "Traceback" not in res.err and "interrupted" in res.err


def test_chat_double_ctrl_c_keeps_the_session():
    run = _Run("chat", "-t", "1", "-n", "-1", "-c", "100000", "--temp", "0")
    try:
        run.wait_for("Ctrl-C stops", "the chat's help line")
        run.wait_for(_at_prompt, "the prompt")
        asked = len(run.text())
        run.write("tell me\n")
        run.wait_for(lambda text: len(text) > asked, "the answer's first line")  # generating
        run.proc.send_signal(signal.SIGINT)
        run.wait_for(lambda text: "| interrupted" in text[asked:] and _at_prompt(text),
                     "the prompt after the stopped answer")
        pressed = len(run.text())
        run.proc.send_signal(signal.SIGINT)  # a quick double press: at the prompt, at once
        run.wait_for(lambda text: "> " in text[pressed:],
                     "the prompt again: a quick second Ctrl-C must not end the session")
        assert run.proc.poll() is None, "a quick second Ctrl-C must not end the session"
        run.write("/exit\n")
        rc = run.finish()
    finally:
        run.kill()
    assert rc == 0 and "bye" in run.text()


def test_chat_full_context_hints_reset_and_drops_the_failed_turn():
    long_line = "def f(x): return x " * 40
    res = spac("chat", "-t", "1", "-n", "8", "-c", "64", "--temp", "0",
               stdin=f"{long_line}\nhello\n/reset\nhello\n")
    assert res.returncode == 0, res.err
    assert "/reset" in res.out and res.out.count("tokens,") == 2, res.out  # the failed turn is not kept


def test_chat_long_answer_streams_past_the_terminal_height():
    """On a terminal of 12 rows, a 400-token answer is printed line by line above the live status
    instead of freezing behind rich's '...'."""
    env = {**os.environ, "FORCE_COLOR": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "40", "LINES": "12"}
    res = subprocess.run([sys.executable, "-m", "orchestrator.cli", "chat", "-t", "1", "-n", "400", "--temp", "0"],
                         cwd=ROOT, input=b"def main():\n", capture_output=True, env=env, timeout=120)
    text = res.stdout.decode(errors="replace")
    assert res.returncode == 0, res.stderr
    assert "\n...\n" not in text.replace("\x1b[2m", "").replace("\x1b[0m", "")
    assert text.count("\n") > 12
