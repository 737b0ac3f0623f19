"""Soak: a long `spac chat` session driven through its stdin, as a user would.

    python bench/soak_chat.py                      # 200 turns, /reset every 20, shipped models
    python bench/soak_chat.py --turns 40 -- --device CPU --expert-budget 50%

Each turn sends one line and waits for the answer's summary line (`N tokens, ...`); the chat
process's RSS is read after every turn. Pass: no error line, at least --min-tokens generated,
and RSS after the last turn within --max-growth-mb of RSS after the first /reset (the first 20
turns warm up allocators and caches). Not a CI step: it takes minutes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):", "# parse the arguments",
           "with open(path) as f:", "def __init__(self, name):", "return sorted(items, key=", "try:", "while True:"]
SUMMARY = re.compile(r"^(\d+) tokens, .* tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--reset-every", type=int, default=20)
    ap.add_argument("-n", "--n-predict", type=int, default=160, help="max tokens per answer")
    ap.add_argument("--min-tokens", type=int, default=20_000)
    ap.add_argument("--max-growth-mb", type=float, default=20.0)
    ap.add_argument("chat_args", nargs="*", help="more `spac chat` arguments, after --")
    args = ap.parse_args(argv)

    cmd = [sys.executable, "-m", "orchestrator.cli", "chat", "-n", str(args.n_predict), "-c", "8192", "-t", "2",
           "--temp", "0.8", "--seed", "1", *args.chat_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    lines: list[str] = []
    errors: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    threading.Thread(target=lambda: errors.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    ps = psutil.Process(proc.pid)

    def wait_for(pred, timeout=300.0) -> str:
        deadline = time.time() + timeout
        seen = len(lines)
        while True:
            for line in lines[seen:]:
                if pred(line):
                    return line
            seen = len(lines)
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"chat stopped or stalled; last output: {''.join(lines[-5:])!r}{''.join(errors)}")
            time.sleep(0.01)

    wait_for(lambda ln: "Ctrl-C stops" in ln, 120)
    rss, tokens, failed, t0 = [], 0, [], time.time()
    for turn in range(args.turns):
        if turn and turn % args.reset_every == 0:
            proc.stdin.write("/reset\n")
        proc.stdin.write(PROMPTS[turn % len(PROMPTS)] + "\n")
        proc.stdin.flush()
        line = wait_for(lambda ln: bool(SUMMARY.match(ln)) or ln.startswith("error: ") or "/reset starts" in ln)
        if not SUMMARY.match(line) or "/reset starts" in line:
            failed.append((turn, line.strip()))
        else:
            tokens += int(SUMMARY.match(line).group(1))
        rss.append(ps.memory_info().rss)
    proc.stdin.write("/exit\n")
    proc.stdin.flush()
    rc = proc.wait(timeout=60)
    wall = time.time() - t0
    base = rss[min(args.reset_every, len(rss)) - 1]
    growth_mb = (rss[-1] - base) / 2**20
    print(f"turns {args.turns}, /reset every {args.reset_every}, tokens {tokens}, wall {wall:.0f} s "
          f"({tokens / wall:.0f} tok/s over the session), exit code {rc}")
    print(f"RSS MiB: after turn 1 {rss[0] / 2**20:.1f}, after turn {args.reset_every} {base / 2**20:.1f}, "
          f"after turn {len(rss)} {rss[-1] / 2**20:.1f}, max {max(rss) / 2**20:.1f}; "
          f"growth after warm-up {growth_mb:+.1f} MiB")
    print(f"failed turns: {len(failed)} {failed[:3]}; stderr lines: {len(errors)}")
    ok = (rc == 0 and not failed and tokens >= args.min_tokens and growth_mb < args.max_growth_mb
          and not any("Traceback" in e or "error" in e for e in errors))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
