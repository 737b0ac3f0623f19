"""Bounded load test of `spac serve` on loopback.

    python bench/load_serve.py [--clients 32] [--requests 4] [--max-tokens 32] [--queue 16] [--retries 0]
                               [-- serve options]

Starts `spac serve` (the shipped models, the engine on a CPU buffer when built), then runs
`clients` concurrent clients, each sending `requests` requests in turn: chat and completions,
streaming and not, and every fourth a stream that the client drops after two chunks. Checks
that every request got a complete answer (200 with a finish_reason; a stream ending in
`[DONE]`) or a clear 503 (OpenAI error JSON with Retry-After), that the server did not crash
and still answers /health, and that its RSS grew by less than 50 MB from after a warm-up to
after the load. Prints one JSON object; exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
RSS_LIMIT_MB = 50
RETRY_AFTER_S = 1  # what the server's Retry-After says


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_serve_args() -> list[str]:
    from orchestrator.runtime.native import engine_built

    engine = ["--engine", "--device", "CPU", "--expert-budget", "50%"] if engine_built() else ["--no-engine"]
    return ["--draft-max", "4", "-c", "1024", "-t", "1", "--temp", "0", *engine]


KINDS = ("chat", "chat_stream", "completion", "completion_drop")


def request_for(kind: str, client: int, i: int, max_tokens: int) -> tuple[str, dict]:
    if kind.startswith("chat"):
        body = {"messages": [{"role": "user", "content": f"def task_{client}_{i}(x):"}], "max_tokens": max_tokens,
                "stream": kind == "chat_stream"}
        return "/v1/chat/completions", body
    return "/v1/completions", {"prompt": f"import os\n# client {client}, request {i}\n", "max_tokens": max_tokens,
                               "stream": kind == "completion_drop", "temperature": 0.7, "seed": client * 100 + i}


def check_503(status: int, headers, text: str) -> str:
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return "bad_503_body"
    return "503" if err.get("type") == "unavailable_error" and headers.get("retry-after") else "bad_503_body"


async def one(http: httpx.AsyncClient, kind: str, client: int, i: int, max_tokens: int) -> str:
    """The outcome: "ok", "dropped" (we hung up on purpose), "503", or a failure name."""
    path, body = request_for(kind, client, i, max_tokens)
    if not body["stream"]:
        r = await http.post(path, json=body)
        if r.status_code == 503:
            return check_503(r.status_code, r.headers, r.text)
        if r.status_code != 200:
            return f"status_{r.status_code}"
        choice = r.json()["choices"][0]
        return "ok" if choice["finish_reason"] in ("stop", "length") and "timings" in r.json() else "incomplete"
    async with http.stream("POST", path, json=body) as r:
        if r.status_code == 503:
            return check_503(r.status_code, r.headers, (await r.aread()).decode())
        if r.status_code != 200:
            return f"status_{r.status_code}"
        events, finish = 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return "ok" if finish in ("stop", "length") else "incomplete"
            obj = json.loads(data)
            if "error" in obj:
                return "stream_error"
            events += 1
            if obj["choices"] and obj["choices"][0]["finish_reason"]:
                finish = obj["choices"][0]["finish_reason"]
            if kind == "completion_drop" and events == 2 and finish is None:
                return "dropped"  # leaving the block closes the connection mid-stream
        return "truncated"


async def run_clients(url: str, clients: int, requests: int, max_tokens: int,
                      retries: int = 0) -> tuple[Counter, list[float]]:
    outcomes: Counter = Counter()
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def client(c: int) -> None:
            for i in range(requests):
                kind = KINDS[(c + i) % len(KINDS)]
                t0 = time.perf_counter()
                for attempt in range(retries + 1):
                    try:
                        outcome = await one(http, kind, c, i, max_tokens)
                    except httpx.HTTPError as e:
                        outcome = f"transport_{type(e).__name__}"
                    if outcome != "503" or attempt == retries:
                        break
                    outcomes["retried_after_503"] += 1
                    await asyncio.sleep(RETRY_AFTER_S)
                latencies.append(time.perf_counter() - t0)
                outcomes[f"{kind}:{outcome}"] += 1
        await asyncio.gather(*(client(c) for c in range(clients)))
    return outcomes, latencies


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"spac serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("spac serve did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--queue", type=int, default=16, help="spac serve --queue")
    ap.add_argument("--retries", type=int, default=0, help="a client retries a 503 this often, after Retry-After")
    ap.add_argument("serve_args", nargs="*", help="options for spac serve (after --)")
    a = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.setdefault("SPAC_CACHE_DIR", tempfile.mkdtemp(prefix="spac-load-"))
    cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port), "--queue", str(a.queue),
           *(a.serve_args or default_serve_args())]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc)
        ps = psutil.Process(proc.pid)
        asyncio.run(run_clients(url, 4, 1, a.max_tokens))  # warm-up: allocations of a first request
        rss0 = ps.memory_info().rss
        t0 = time.perf_counter()
        outcomes, latencies = asyncio.run(run_clients(url, a.clients, a.requests, a.max_tokens, a.retries))
        wall = time.perf_counter() - t0
        rss1 = ps.memory_info().rss
        health = httpx.get(url + "/health", timeout=10).status_code
        metrics = httpx.get(url + "/metrics", timeout=10).text
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        stderr = proc.stderr.read()

    def metric(name: str) -> float:
        for line in metrics.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    retried = outcomes.pop("retried_after_503", 0)
    bad = {k: v for k, v in outcomes.items() if k.split(":")[1] not in ("ok", "dropped", "503")}
    growth_mb = (rss1 - rss0) / 2**20
    latencies.sort()
    report = {
        "command": " ".join(cmd[1:]), "clients": a.clients, "requests_per_client": a.requests,
        "max_tokens": a.max_tokens, "wall_s": round(wall, 2),
        "outcomes": dict(sorted(outcomes.items())),
        "answered": sum(v for k, v in outcomes.items() if k.endswith(":ok")),
        "dropped_by_client": sum(v for k, v in outcomes.items() if k.endswith(":dropped")),
        "rejected_503": sum(v for k, v in outcomes.items() if k.endswith(":503")), "retried_after_503": retried,
        "failures": bad, "latency_s_p50": round(latencies[len(latencies) // 2], 3),
        "latency_s_max": round(latencies[-1], 3),
        "tokens_predicted": metric("spac_tokens_predicted_total"),
        "verify_steps": metric("spac_verify_steps_total"),
        "verify_step_s_mean": round(metric("spac_verify_step_seconds_sum") / max(metric("spac_verify_step_seconds_count"), 1), 4),
        "rss_mb_before": round(rss0 / 2**20, 1), "rss_mb_after": round(rss1 / 2**20, 1),
        "rss_growth_mb": round(growth_mb, 1), "health_after": health, "alive_after": alive,
        "exit_status_after_sigterm": rc, "traceback_in_stderr": "Traceback" in stderr,
    }
    print(json.dumps(report, indent=1))
    ok = (not bad and alive and health == 200 and growth_mb < RSS_LIMIT_MB and rc == 0
          and "Traceback" not in stderr and sum(outcomes.values()) == a.clients * a.requests)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
