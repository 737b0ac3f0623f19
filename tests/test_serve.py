"""`spac serve`: a real server process on 127.0.0.1, spoken to with the official `openai` client
(streaming and not) and plain HTTP (httpx) for the rest.

The main server runs the shipped tiny target and its Q4_0 self-draft with the expert engine on
a second CPU buffer (--device CPU) when it is built, greedy by default (--temp 0)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.cli.setup import default_models
from orchestrator.runtime.native import engine_built

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFT = default_models()
MODEL_ARGS = ["-m", str(TARGET), "-md", str(DRAFT), "--draft-max", "4", "-c", "512", "-t", "1",
              *(["--engine", "--device", "CPU", "--expert-budget", "50%"] if engine_built() else ["--no-engine"])]
GREEDY = ["--temp", "0"]
LOAD_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`spac serve` in a subprocess; `stop` sends a signal and returns the exit status."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(self.port),
                                      *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.health_codes: list[int] = []

    def wait_ready(self) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"spac serve exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.health_codes.append(code)
            if code == 200:
                return
            time.sleep(0.05)
        pytest.fail("spac serve did not become healthy")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("spac serve did not stop after the signal")

    def client(self, api_key: str = "none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def post(self, path: str, body=None, content: bytes | None = None, headers=None, timeout: float = 120):
        if content is None:
            content = json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers=headers or {}, timeout=timeout)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ, SPAC_CACHE_DIR=str(tmp_path_factory.mktemp("serve-cache")))
    e.pop("SPAC_API_KEY", None)
    return e


@pytest.fixture(scope="module")
def start(env):
    servers: list[Server] = []

    def start_server(*args: str) -> Server:
        s = Server(list(args), env)
        servers.append(s)
        s.wait_ready()
        return s

    yield start_server
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def server(start) -> Server:
    return start(*MODEL_ARGS, *GREEDY)


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return server.client().models.list().data[0].id


def cli_generate(env, prompt: str, n: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "generate", prompt, "-n", str(n), "--json",
                        *MODEL_ARGS, *GREEDY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the openai client

def test_health_and_models(server, model_id):
    assert server.health_codes[-1] == 200 and set(server.health_codes) <= {200, 503}
    assert model_id == TARGET.name
    r = httpx.get(server.url + "/v1/models").json()
    assert r["data"][0]["meta"]["n_ctx"] == 512


def test_openai_chat_streaming_equals_non_streaming(server, model_id):
    client = server.client()
    messages = [{"role": "user", "content": "def add(a, b):"}]
    full = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length") and text
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    timings = full.model_extra["timings"]
    assert timings["predicted_n"] == full.usage.completion_tokens and timings["mode"] == "speculative"
    assert 0.0 <= timings["acceptance_rate"] <= 1.0
    if engine_built():
        assert 0.0 <= timings["device_share"] <= 1.0 and timings["bytes_copied"] >= 0

    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert "timings" in finals[0].model_extra
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_completions_greedy_identical_to_spac_generate(server, model_id, env):
    prompt, n = "def fibonacci(n):", 40
    expected = cli_generate(env, prompt, n)
    client = server.client()
    for _ in range(2):  # the second time with the prompt in the KV cache
        full = client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0)
        assert full.choices[0].text == expected["text"]
        assert full.usage.completion_tokens == expected["n_tokens"]
        stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == expected["text"]


def test_sampling_options_and_stop(server, model_id):
    client = server.client()
    kw = dict(model=model_id, prompt="import numpy as np\n", max_tokens=16, temperature=0.9, top_p=0.9,
              extra_body={"top_k": 20})
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a  # same seed, same text
    greedy = client.completions.create(model=model_id, prompt="def f(x):", max_tokens=24).choices[0].text
    stop = greedy.strip()[:3]
    assert stop
    cut = client.completions.create(model=model_id, prompt="def f(x):", max_tokens=24, stop=[stop])
    assert cut.choices[0].text == greedy[:greedy.index(stop)] and cut.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- prompt cache

def test_second_chat_turn_processes_only_new_tokens(server, model_id, start):
    client = server.client()
    messages = [{"role": "user", "content": "class Stack:\n    def push(self, x):"}]
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=16)
    t1 = first.model_extra["timings"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "\n    def pop(self):"}]
    second = client.chat.completions.create(model=model_id, messages=messages, max_tokens=16)
    t2 = second.model_extra["timings"]
    n_new = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert t2["cache_n"] + t2["prompt_n"] == second.usage.prompt_tokens
    assert t2["cache_n"] >= first.usage.prompt_tokens
    assert t2["prompt_n"] <= n_new + 2, (t1, t2)  # a token or two where the texts join may re-tokenize
    assert second.usage.prompt_tokens_details.cached_tokens == t2["cache_n"]
    # the same answer as a server that computes the whole conversation (and exits 0 on SIGINT)
    fresh = start(*MODEL_ARGS, *GREEDY)
    again = fresh.client().chat.completions.create(model=model_id, messages=messages, max_tokens=16)
    assert again.model_extra["timings"]["cache_n"] == 0
    assert again.choices[0].message.content == second.choices[0].message.content
    assert fresh.stop(signal.SIGINT) == 0


# ----------------------------------------------------------------------------- plain HTTP

def test_tokenize_detokenize_metrics(server):
    toks = server.post("/tokenize", {"content": "def f(x):"}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    assert server.post("/detokenize", {"tokens": toks}).json()["content"] == "def f(x):"
    pieces = server.post("/tokenize", {"content": "def", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "def"
    text = httpx.get(server.url + "/metrics").text
    for name in ("spac_tokens_predicted_total", "spac_prompt_tokens_cached_total", "spac_draft_tokens_accepted_total",
                 "spac_bytes_copied_total", "spac_verify_step_seconds_bucket", "spac_requests_queued"):
        assert name in text
    assert server.metric("spac_verify_step_seconds_count") > 0


BAD = [  # (name, request kwargs, status, error param or code)
    ("malformed_json", dict(path="/v1/chat/completions", content=b'{"messages": [{"role": "user",'), 400,
     "invalid_json"),
    ("not_an_object", dict(path="/v1/completions", body=["hi"]), 400, None),
    ("missing_messages", dict(path="/v1/chat/completions", body={"model": "x"}), 400, "messages"),
    ("missing_prompt", dict(path="/v1/completions", body={"max_tokens": 4}), 400, "prompt"),
    ("messages_wrong_type", dict(path="/v1/chat/completions", body={"messages": "hi"}), 400, "messages"),
    ("max_tokens_wrong_type", dict(path="/v1/completions", body={"prompt": "a", "max_tokens": "ten"}), 400,
     "max_tokens"),
    ("temperature_negative", dict(path="/v1/completions", body={"prompt": "a", "temperature": -1}), 400,
     "temperature"),
    ("n_not_one", dict(path="/v1/completions", body={"prompt": "a", "n": 2}), 400, "n"),
    ("token_out_of_vocab", dict(path="/v1/completions", body={"prompt": [1, 10 ** 9]}), 400, "prompt"),
    ("unknown_model", dict(path="/v1/chat/completions",
                           body={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}), 404,
     "model_not_found"),
    ("prompt_too_long", dict(path="/v1/completions", body={"prompt": "def f(x): return x\n" * 200}), 400,
     "context_length_exceeded"),
    ("unknown_route", dict(path="/v1/embeddings", body={"input": "x"}), 404, None),
]


@pytest.mark.parametrize("name,kw,status,what", BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_good_one(server, name, kw, status, what):
    kw = dict(kw)
    path = kw.pop("path")
    r = server.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if what is not None:
        assert what in (err["param"], err["code"]), err
    ok = server.post("/v1/completions", {"prompt": "def", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_client_disconnect_stops_generation(server):
    steps0, tokens0 = server.metric("spac_verify_steps_total"), server.metric("spac_tokens_predicted_total")
    # sampled: γ stays at --draft-max, every step a verification pass. Greedy decoding of the tiny
    # model settles on γ = 0, whose sub-millisecond steps outrun the few milliseconds the server
    # takes to hear of the disconnect, so a bound in steps would measure the event loop instead
    body = {"prompt": "def f(x):", "max_tokens": 400, "temperature": 0.8, "seed": 1, "stream": True}
    seen = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    break
    # the job's counters are added when it ends (before it stops counting as processing)
    deadline = time.monotonic() + 120
    while server.metric("spac_requests_processing") or server.metric("spac_tokens_predicted_total") <= tokens0:
        assert time.monotonic() < deadline, "the job of the client that went away did not end"
        time.sleep(0.05)
    steps = server.metric("spac_verify_steps_total") - steps0
    assert server.metric("spac_tokens_predicted_total") - tokens0 < 400
    assert steps <= seen + 2, steps  # one chunk per step; it stops within one step of the disconnect
    assert server.post("/v1/completions", {"prompt": "def", "max_tokens": 2}).status_code == 200


# ----------------------------------------------------------------------------- API key, queue, signals

def test_api_key(start):
    s = start(*MODEL_ARGS, "--no-engine", "--api-key", "sekrit")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        r = s.post("/v1/chat/completions", body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(s.url + "/health").status_code == 200  # public, as llama-server's
    with pytest.raises(openai.AuthenticationError):
        s.client("wrong").chat.completions.create(model=TARGET.name, **body)
    assert s.client("sekrit").chat.completions.create(model=TARGET.name, **body).choices[0].message.content
    assert s.post("/v1/completions", {"prompt": "a", "max_tokens": 1}, headers={"X-Api-Key": "sekrit"}).status_code == 200


def test_full_queue_503_then_sigterm_ends_stream_cleanly(start):
    s = start(*MODEL_ARGS, "--no-engine", "--queue", "1", *GREEDY)
    long = {"prompt": "def f(x):", "max_tokens": 100000, "stream": True}
    lines: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    queued: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: queued.append(s.post("/v1/completions", {"prompt": "a", "max_tokens": 1})))
    waiter.start()
    deadline = time.monotonic() + 30
    while s.metric("spac_requests_queued") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = s.post("/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "unavailable_error"

    assert s.stop(signal.SIGTERM) == 0
    reader.join(30)
    waiter.join(30)
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert queued[0].status_code == 503
    assert "Traceback" not in s.proc.stderr.read()


def test_bad_model_fails_with_one_line(env, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(free_port()), "-m", str(junk),
                        "--no-engine"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a GGUF file" in r.stderr


# ----------------------------------------------------------------------------- in process: loading

def test_health_503_while_loading_then_200_or_failed():
    from starlette.testclient import TestClient

    from orchestrator.runtime.llm import ModelError
    from orchestrator.server import SessionWorker, create_app

    class Loaded:  # what the worker thread holds once "loaded"; no request reaches it here
        def close(self) -> None:
            pass

    gate = threading.Event()
    worker = SessionWorker(lambda: (gate.wait(30), Loaded())[1])
    with TestClient(create_app(worker, "m.gguf")) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert r.headers["Retry-After"] == "1"
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 503
        gate.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.get("/health").json() == {"status": "ok"}

    def fail():
        raise ModelError("model file not found: nope.gguf")

    failures: list[str] = []
    worker = SessionWorker(fail, on_failed=failures.append)
    with TestClient(create_app(worker, "nope.gguf")) as c:
        worker.join(30)
        r = c.get("/health")
        assert r.status_code == 503 and "model file not found: nope.gguf" in r.json()["error"]["message"]
    assert failures == ["model file not found: nope.gguf"]


# ----------------------------------------------------------------------------- in process: the queue

class StepSession:
    """Stands in for Session in the worker: one "x" per verification step; prompt [0] waits for
    `gate` before its first step."""

    def __init__(self) -> None:
        from orchestrator.decoding.metrics import RunMetrics

        self.metrics_type = RunMetrics
        self.gate = threading.Event()
        self.on_verify_step = None
        self.last_metrics = None
        self.started: list[int] = []
        self.closed = False

    def generate(self, prompt, max_tokens, stop, sampling):
        self.started.append(prompt[0])
        m = self.metrics_type(n_prompt_tokens=len(prompt), stop_reason="length")
        try:
            if prompt[0] == 0:
                self.gate.wait(30)
            for _ in range(max_tokens):
                time.sleep(0.001)
                self.on_verify_step(0.001)
                m.n_tokens += 1
                yield "x"
        finally:
            self.last_metrics = m

    def close(self) -> None:
        self.closed = True


def test_worker_fifo_full_queue_cancel_and_shutdown():
    import asyncio

    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.server.worker import SessionWorker, Job, QueueFull

    fake = StepSession()

    async def drain(job: Job) -> tuple[str, object]:
        text = ""
        while (ev := await asyncio.wait_for(job.events.get(), 30)).kind == "text":
            text += ev.text
        return text, ev

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        worker = SessionWorker(lambda: fake, queue_size=2)
        worker.start()
        while not worker.ready:
            await asyncio.sleep(0.01)
        jobs = [Job([i], 3, [], SamplingParams(), loop) for i in range(4)]
        worker.submit(jobs[0])
        while worker.current is not jobs[0]:
            await asyncio.sleep(0.01)
        worker.submit(jobs[1])
        worker.submit(jobs[2])
        with pytest.raises(QueueFull):
            worker.submit(jobs[3])
        assert worker.status() == {"state": "ready", "processing": 1, "queued": 2}
        jobs[2].cancel()  # its client left while it waited: never started
        fake.gate.set()
        for job in jobs[:2]:
            text, ev = await drain(job)
            assert (text, ev.kind, ev.aborted) == ("xxx", "done", False)
        long = Job([9], 10 ** 6, [], SamplingParams(), loop)
        worker.submit(long)
        first = await asyncio.wait_for(long.events.get(), 30)
        assert first.kind == "text"
        worker.shutdown()
        text, ev = await drain(long)
        text = first.text + text
        assert ev.kind == "done" and ev.aborted and ev.metrics.stop_reason == "abort"
        assert ev.metrics.n_tokens == len(text) < 10 ** 6
        await asyncio.to_thread(worker.join, 30)
        assert fake.started == [0, 1, 9] and fake.closed

    asyncio.run(scenario())
