"""The MTP draft (issue 40) beside the pool draft and a Q4_0 self-draft, on a memory-bound hybrid:
the Qwen3.6-35B-A3B-shaped synthetic file (scripts/make_synthetic_moe.py's preset, a few layers,
F16, with its MTP layer), against target-only in the same run.

Each configuration runs in its own process: greedy, the same prompts, a fixed γ, the expert pool
on the test device (a second CPU buffer) at --budget. Per row: tokens/s and its ratio to
target-only's, acceptance, the draft's time per drafted token (a step's drafting, the MTP head's
catch-up included, over the tokens it drafted), the verify pass's time (target-only: one
decode), and whether the text equals target-only's (else the first token where it parts).

    .venv/bin/python scripts/make_synthetic_moe.py qwen3.6-35b-a3b runs/mtp-bench/qwen36-4l-mtp-f16.gguf \\
        --n-layer 4 --mtp-layers 1 --dtype f16
    .venv/bin/python bench/bench_mtp.py -m runs/mtp-bench/qwen36-4l-mtp-f16.gguf

The Q4_0 self-draft is made next to the target with `spac draft quantized` where missing. The
weights are random: the acceptance says nothing about a trained model's; the costs are the
file's. Timings mean something only on an idle machine: the CPU's flags and the load (`uptime`)
are printed with the results, and the run waits (up to --wait minutes) for a 1-minute load
below --max-load first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_drafts import PROMPTS

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = ("none", "mtp", "pool", "q4_0")


def run_one(args) -> dict:
    """One configuration, in this process: its tokens per prompt and its timings."""
    from orchestrator.decoding.mtp_draft import MTP_DRAFT
    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.decoding.speculative import POOL_DRAFT, Session, SessionConfig
    from orchestrator.runtime.pool import Budget, PoolDevice

    draft = {"none": None, "pool": POOL_DRAFT, "mtp": MTP_DRAFT}.get(args.draft, args.draft)
    cfg = SessionConfig(model=args.model, draft=draft, gamma=args.gamma, adaptive_gamma=False, n_ctx=1024,
                        n_threads=args.threads, expert_engine=True, pool=(PoolDevice("CPU", Budget(ratio=args.budget)),),
                        calibration_cache=Path(args.tmp) / f"cal-{Path(str(args.draft)).name}.json")
    steps: list[tuple[int, int, float, float]] = []
    tokens, n_tok, decode_s = [], 0, 0.0
    with Session(cfg) as s:
        s.complete(PROMPTS[0], max_tokens=8)  # warm-up
        after_verify = s._after_verify

        def timed(n_drafted, n_accepted, draft_s, verify_s):
            steps.append((n_drafted, n_accepted, draft_s, verify_s))
            after_verify(n_drafted, n_accepted, draft_s, verify_s)

        s._after_verify = timed
        for p in PROMPTS[:args.prompts]:
            s.reset()
            tokens.append(s.complete(p, max_tokens=args.n, sampling=SamplingParams()).tokens)
            n_tok, decode_s = n_tok + s.last_metrics.n_tokens, decode_s + s.last_metrics.decode_s
        mode = s.mode
    drafted = sum(st[0] for st in steps)
    return dict(draft=args.draft, mode=mode, tokens=tokens, tok_s=n_tok / max(decode_s, 1e-9), n_steps=len(steps),
                drafted=drafted, acceptance=sum(st[1] for st in steps) / drafted if drafted else None,
                draft_ms=1e3 * sum(st[2] for st in steps) / drafted if drafted else None,
                verify_ms=1e3 * sum(st[3] for st in steps) / max(len(steps), 1))


def load1() -> float:
    return os.getloadavg()[0]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    keep = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2")
    return f"{model}, {os.cpu_count()} CPUs; flags: {' '.join(keep) or 'none of avx2/avx512*/amx*'}"


def first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        j = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None if len(g) == len(w) else min(len(g), len(w)))
        if j is not None:
            return f"prompt {i} token {j}"
    return "equal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="a hybrid target with an MTP layer (F16 or F32)")
    ap.add_argument("-md", "--model-draft", help="the Q4_0 self-draft [default: made next to the target]")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--drafts", default=",".join(DRAFTS))
    ap.add_argument("--max-load", type=float, default=2.5)
    ap.add_argument("--wait", type=int, default=10, help="minutes to wait for the load to drop, at most")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--draft", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args)))
        return

    target = Path(args.model)
    q4 = Path(args.model_draft) if args.model_draft else target.with_name(target.stem + "-draft-q4_0.gguf")
    if not q4.exists():
        subprocess.run([str(Path(sys.executable).parent / "spac"), "draft", "quantized", str(target), str(q4),
                        "--type", "q4_0"], check=True)
    for _ in range(args.wait):
        if load1() <= args.max_load:
            break
        print(f"load {load1():.2f} > {args.max_load}: waiting 60 s", file=sys.stderr)
        time.sleep(60)
    loads = [uptime()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.drafts.split(","):
            draft = str(q4) if name == "q4_0" else name
            cmd = [sys.executable, __file__, "--child", "-m", str(target), "--draft", draft, "--budget", str(args.budget),
                   "--gamma", str(args.gamma), "-n", str(args.n), "--prompts", str(args.prompts),
                   "-t", str(args.threads), "--tmp", tmp]
            t0 = time.time()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{name}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            r.update(name=name, wall_s=time.time() - t0)
            rows.append(r)
            loads.append(uptime())
    print(f"target {target.name} ({target.stat().st_size / 2**30:.1f} GiB), Q4_0 self-draft {q4.name} "
          f"({q4.stat().st_size / 2**30:.1f} GiB); γ={args.gamma} fixed, {args.prompts} prompts x {args.n} tokens, "
          f"greedy, pool {args.budget:.0%} on the CPU test device, {args.threads} threads")
    print(f"CPU: {cpu_flags()}")
    print("load: " + "\n      ".join(loads))
    base = next((r for r in rows if r["name"] == "none"), None)
    print(f"{'draft':6} {'mode':>12} {'tok/s':>7} {'vs none':>8} {'accept':>7} {'drafted':>8} {'draft ms/tok':>13} "
          f"{'verify ms':>10} {'text vs none':>16}")
    for r in rows:
        rel = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        dms = f"{r['draft_ms']:.1f}" if r["draft_ms"] is not None else "-"
        same = first_difference(r["tokens"], base["tokens"]) if base else "-"
        print(f"{r['name']:6} {r['mode']:>12} {r['tok_s']:>7.2f} {rel:>8} {acc:>7} {r['drafted']:>8} {dms:>13} "
              f"{r['verify_ms']:>10.1f} {same:>16}")


if __name__ == "__main__":
    main()
