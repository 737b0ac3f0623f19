"""`spac rpc-server` and `--rpc`: llama.cpp's way to use another machine's device, here a server
process on 127.0.0.1. Every client runs in a process of its own: a registered RPC device cannot
be unregistered, so it must not outlive its server in the test session."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.runtime.native import engine_built
from orchestrator.runtime.rpc import _free_port

SPAC = [sys.executable, "-m", "orchestrator.cli"]
ROOT = Path(__file__).resolve().parent.parent


def spac(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*SPAC, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def server():
    """A `spac rpc-server` on a free port, one thread; its HOST:PORT."""
    port = _free_port()
    proc = subprocess.Popen([*SPAC, "rpc-server", "-p", str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert "RPC server on" in proc.stderr.readline()
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def two_servers():
    """Two `spac rpc-server`s: two devices, RPC0 and RPC1; their HOST:PORTs joined by a comma."""
    procs, endpoints = [], []
    try:
        for _ in range(2):
            port = _free_port()
            procs.append(subprocess.Popen([*SPAC, "rpc-server", "-p", str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True, cwd=ROOT))
            assert "RPC server on" in procs[-1].stderr.readline()
            endpoints.append(f"127.0.0.1:{port}")
        yield ",".join(endpoints), procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def wait_for_port(port: int, proc: subprocess.Popen, seconds: float = 120) -> None:
    """Until the server on 127.0.0.1:port accepts a connection (ggml's accept loop is running);
    a bare connection is dropped as a client without HELLO, and the server serves on."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the RPC server on port {port} never answered (exit code {proc.poll()})")
            time.sleep(0.05)


def wait_for_first_text(client: subprocess.Popen, seconds: float = 120) -> None:
    """Until the client has written its first generated text on stdout: the model is loaded on
    the RPC device(s) and decoding runs there."""
    ready, _, _ = select.select([client.stdout], [], [], seconds)
    if not ready:
        client.kill()
        pytest.fail(f"the client printed no text in {seconds} s: {client.communicate()[1][-2000:]}")
    if not os.read(client.stdout.fileno(), 4096):  # end of file: it exited before generating
        pytest.fail(f"the client exited ({client.wait()}) before generating: {client.stderr.read()[-2000:]}")


LONG_PROMPT = "def f(x):\n    return x\n" * 30  # 239 tokens: a streamed prefill (more than 64)


def generate(*args: str, prompt: str = "Once upon a time") -> dict:
    res = spac("generate", prompt, "-n", "32", "--temp", "0", "-t", "1", "--json", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_the_pool_on_an_rpc_server_gives_the_target_only_text(server):
    reference = generate("--no-engine", "--draft", "none")["text"]
    for args in (["--expert-budget", "25%"], ["--expert-budget", "50%"], ["--expert-budget", "25%", "--draft", "pool"]):
        out = generate("--rpc", server, "--device", "RPC0", *args)
        assert out["text"] == reference, args
        assert out["pool_device"] == "RPC0" and out["bytes_copied"] > 0, args  # the pool was on the server
    # a long prompt streams its experts through the pool (on by default on an RPC pool), both modes
    reference = generate("--no-engine", "--draft", "none", prompt=LONG_PROMPT)["text"]
    for args in ([], ["--stream-prefill", "used"], ["--draft", "pool"]):
        out = generate("--rpc", server, "--device", "RPC0", "--expert-budget", "25%", *args, prompt=LONG_PROMPT)
        assert out["text"] == reference, args
        assert out["bytes_staged"] > 0, args


def test_bad_rpc_servers_are_one_line_and_exit_2():
    res = spac("generate", "x", "-n", "2", "--rpc", "not-an-endpoint")
    assert res.returncode == 2 and "--rpc" in res.stderr and "HOST:PORT" in res.stderr
    res = spac("generate", "x", "-n", "2", "--rpc", f"127.0.0.1:{_free_port()}", "--device", "RPC0")
    assert res.returncode == 2 and "--rpc" in res.stderr and "no RPC server answers" in res.stderr
    assert "Traceback" not in res.stderr


def test_rpc_server_refuses_bad_flags():
    res = spac("rpc-server", "-p", "70000")
    assert res.returncode == 2 and "-p/--port" in res.stderr
    res = spac("rpc-server", "-p", str(_free_port()), "-d", "NO-SUCH-DEVICE")
    assert res.returncode == 2 and "NO-SUCH-DEVICE" in res.stderr


def test_rpc_server_stops_on_ctrl_c():
    port = _free_port()
    proc = subprocess.Popen([*SPAC, "rpc-server", "-p", str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert "RPC server on" in proc.stderr.readline()
    wait_for_port(port, proc)  # serving, not only about to
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err


def test_rpc_server_warns_off_loopback():
    """Listening beyond this machine prints llama.cpp's warning: the protocol is unauthenticated."""
    proc = subprocess.Popen([*SPAC, "rpc-server", "-H", "0.0.0.0", "-p", str(_free_port()), "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        first = proc.stderr.readline()
        assert "WARNING" in first and "untrusted network" in first
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_a_server_that_dies_mid_run_is_one_line_and_exit_2():
    """ggml's RPC client aborts the process when its server goes away: spac says so and exits 2
    at once (no SIGABRT backtrace, no hang)."""
    port = _free_port()
    server = subprocess.Popen([*SPAC, "rpc-server", "-p", str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert "RPC server on" in server.stderr.readline()
    client = subprocess.Popen([*SPAC, "generate", "Once upon a time", "-n", "-1", "-c", "4096", "-t", "1",
                               "--rpc", f"127.0.0.1:{port}", "--device", "RPC0", "--expert-budget", "25%"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for_first_text(client)  # mid-run
    server.kill()
    server.wait()
    _, err = client.communicate(timeout=60)
    assert client.returncode == 2, err[-2000:]
    assert "--rpc" in err and "RPC server" in err and "Traceback" not in err
    assert not re.search(r"[/\\][^\s:]*\.(c|cpp):\d+", err), err[-2000:]  # file:line, no build directory


def test_ggml_messages_name_the_file_and_line_without_the_build_directory():
    from orchestrator.runtime.rpc import without_build_paths

    said = "/home/ci/spac/vendor/llama-cpp-python/vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:587: Remote RPC server crashed"
    assert without_build_paths(said) == "ggml-rpc.cpp:587: Remote RPC server crashed"
    assert without_build_paths("C:\\b\\ggml\\src\\ggml.c:12: GGML_ASSERT(x) failed") == "ggml.c:12: GGML_ASSERT(x) failed"
    assert without_build_paths("ggml.c:12: fine as it is") == "ggml.c:12: fine as it is"


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_the_pool_over_two_rpc_servers_gives_the_target_only_text(two_servers):
    """Two servers, two devices: llama.cpp's layer split puts layers 0..3 on the first and 4..5
    on the second, each device's pool holds its own layers' experts; every budget, the pool
    draft and a streamed prefill give the target-only text, and each device reports its copies."""
    endpoints, _ = two_servers
    two = ["--rpc", endpoints, "--device", "RPC0,RPC1"]
    reference = generate("--no-engine", "--draft", "none")["text"]
    for budget in ("25%", "50%", "25%,50%"):
        for draft in ([], ["--draft", "pool"]):
            out = generate(*two, "--expert-budget", budget, *draft)
            assert out["text"] == reference, (budget, draft)
            assert [d["device"] for d in out["per_device"]] == ["RPC0", "RPC1"]
            assert all(d["bytes_copied"] > 0 and d["n_expert_tokens_device"] > 0 for d in out["per_device"]), out
            assert "RPC0: layers 0..3" in out["notes"][-1] and "RPC1: layers 4..5" in out["notes"][-1]
    # without --device, every GPU-type device ggml sees takes layers (as llama.cpp), each with its pool
    out = generate("--rpc", endpoints, "--expert-budget", "25%")
    assert out["text"] == reference and [d["device"] for d in out["per_device"]] == ["RPC0", "RPC1"]
    reference = generate("--no-engine", "--draft", "none", prompt=LONG_PROMPT)["text"]
    assert generate(*two, "--expert-budget", "25%", prompt=LONG_PROMPT)["text"] == reference
    # the summary line says what each device copied; --dry-run the placement per device
    res = spac("generate", "Once upon a time", "-n", "16", "--temp", "0", "-t", "1", *two, "--expert-budget", "25%")
    assert res.returncode == 0 and "copied (RPC0 " in res.stderr and ", RPC1 " in res.stderr, res.stderr[-2000:]
    res = spac("generate", "x", "--dry-run", "--json", *two, "--expert-budget", "25%,50%")
    plan = json.loads(res.stdout)
    assert plan["pool_devices"] == [{"name": "RPC0", "budget_bytes": 0, "budget_ratio": 0.25},
                                    {"name": "RPC1", "budget_bytes": 0, "budget_ratio": 0.5}]


def test_bad_device_lists_are_one_line_and_exit_2(two_servers):
    endpoints, _ = two_servers
    for args, said in ((["--device", "RPC0,RPC0"], "distinct"), (["--device", "RPC0,CPU"], "CPU"),
                       (["--device", "RPC0,RPC7"], "RPC7: no such device"),
                       (["--device", "RPC0,RPC1", "--expert-budget", "10%,20%,30%"], "3 values for 2 device"),
                       (["--device", "RPC0", "--expert-budget", "10%,20%"], "2 values for 1 device")):
        res = spac("generate", "x", "-n", "2", "--rpc", endpoints, *args)
        assert res.returncode == 2 and said in res.stderr and "Traceback" not in res.stderr, (args, res.stderr[-500:])


@pytest.mark.skipif(not engine_built(), reason="native engine not built")
def test_one_of_two_servers_dying_mid_run_is_one_line_and_exit_2(two_servers):
    endpoints, procs = two_servers
    client = subprocess.Popen([*SPAC, "generate", "Once upon a time", "-n", "-1", "-c", "4096", "-t", "1",
                               "--rpc", endpoints, "--device", "RPC0,RPC1", "--expert-budget", "25%"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for_first_text(client)  # mid-run
    procs[1].kill()
    procs[1].wait()
    _, err = client.communicate(timeout=60)
    assert client.returncode == 2, err[-2000:]
    assert "--rpc" in err and "RPC server" in err and "Traceback" not in err
    assert not re.search(r"[/\\][^\s:]*\.(c|cpp):\d+", err), err[-2000:]  # file:line, no build directory
