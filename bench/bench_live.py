"""Live speed in one run: tok/s of spac and of llama.cpp's own speculative decoding, as ratios
to all-host autoregressive decoding measured in the same run.

Rows (greedy; the same target, draft, prompts, threads and context for all):
    autoregressive           all-host, target alone (the baseline: ratio 1.00)
    spac adaptive γ          all-host speculative, γ chosen every step (≤ --draft-max)
    spac γ=k                 all-host speculative, fixed γ (one row per --gammas value)
    llama.cpp γ=k            upstream's llama-speculative-simple, stock and unpatched
                             (`scripts/build_native.py --stock`), same files, γ = --draft-max
    RPC rows (--rpc)         the RPC device on 127.0.0.1 (server 1 thread, host 1 thread) plays the
                             GPU: every layer's non-expert weights on it (llama.cpp's -ngl 99) and
                             the expert pool at 25% and 50% of the experts: static placement
                             (llama.cpp's --n-cpu-moe) + speculative, and spac's default policy +
                             speculative

Thread accounting: the RPC server's core is the GPU, so a fair all-host row is the host alone:
run the RPC comparison with `-t 1` (every all-host row on the one host core, as a user without
the GPU would). With `-t 2` the all-host rows get the "GPU's" core too.

Every spac row's text must equal the autoregressive row's, and llama.cpp's text must start with
it (it may run a few tokens past -n); a difference is printed and fails the run. Prompts are
alternated row by row so that machine load hits every row alike. The machine's other load is
reported: CPU time used by other processes during the run, from /proc/stat.

    python bench/bench_live.py -m runs/mb/olmoe-bytes-f16.gguf      # memory-bound target
    python bench/bench_live.py                                      # the shipped tiny target
    python bench/bench_live.py -m T.gguf -md D.gguf --draft-max 8 --gammas 2,4,8 -n 64 --prompts 8
    python bench/bench_live.py -m runs/mb/olmoe-bytes-f16.gguf --rpc -t 1 --gammas '' --no-llama
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from build_native import stock_program  # noqa: E402,F401  (bench_cpu imports it from here too)
from orchestrator.cli.setup import default_models  # noqa: E402
from orchestrator.decoding.sampling import SamplingParams  # noqa: E402
from orchestrator.decoding.speculative import Session, SessionConfig  # noqa: E402
from orchestrator.runtime.pool import Budget, PoolDevice  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "def read_file(path):\n    with open(path) as f:",
           "    return sorted(items, key=", "# Parse the command line\nparser = argparse.", "try:\n    import json"]
WARM_UP = "def main():\n    "


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    texts: list[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


@dataclass
class Row:
    """One configuration: `open()` returns a function prompt → (tokens, seconds, text, drafted,
    accepted, steps) and a close function."""

    name: str
    gamma: str
    open: Callable[[], tuple[Callable[[str], tuple], Callable[[], None]]]
    lossless: bool = True   # text must equal the baseline's
    prefix_ok: bool = False  # text may run past the baseline's (llama.cpp decodes up to -n + γ)
    result: Result = field(default_factory=Result)
    note: str = ""


# ------------------------------------------------------------------------------ spac rows

def spac_row(name: str, gamma: str, cfg: SessionConfig, n: int, policy_factory=None) -> Row:
    def open_():
        s = Session(cfg, policy=policy_factory() if policy_factory else None)
        s.complete(WARM_UP, max_tokens=32)  # warm-up: weights paged in, the governor's first probes

        def run(prompt: str):
            s.reset()
            c = s.complete(prompt, max_tokens=n, sampling=SamplingParams())
            m = c.metrics
            return m.n_tokens, m.decode_s, c.text, m.n_drafted, m.n_accepted, m.n_steps

        def close():
            g = s.governor
            if g is not None:
                row.note = f"γ now {g.best_gamma()}, α {g.alpha:.2f}"
            s.close()
        return run, close
    row = Row(name, gamma, open_)
    return row


# ------------------------------------------------------------------------------ llama.cpp's program

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
DRAFT_STATS = re.compile(r"n_drafted\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", re.S)


def llama_row(exe: Path, target: Path, draft: Path, gamma: int, threads: int, n_ctx: int, n: int) -> Row:
    def open_():
        def run(prompt: str):
            cmd = [str(exe), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "-p", prompt,
                   "-n", str(n), "-c", str(n_ctx), "-t", str(threads), "-td", str(threads),
                   "--spec-draft-n-max", str(gamma), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
                   "--temp", "0", "--top-k", "1", "--seed", "1"]
            res = subprocess.run(cmd, capture_output=True, timeout=1800)
            err = res.stderr.decode(errors="replace")
            if res.returncode != 0:
                raise RuntimeError(f"{exe.name} failed ({res.returncode}):\n{err[-3000:]}")
            m = DECODED.search(err)
            d = DRAFT_STATS.search(err)
            out = res.stdout.decode(errors="replace").strip("\n")
            text = out[len(prompt):] if out.startswith(prompt) else out
            n_tok, secs = int(m.group(1)), float(m.group(2))
            return n_tok, secs, text, int(d.group(1)) if d else 0, int(d.group(2)) if d else 0, 0
        return run, lambda: None
    return Row(f"llama.cpp {exe.name}", str(gamma), open_, prefix_ok=True)


# ------------------------------------------------------------------------------ RPC rows

BUDGETS = (0.25, 0.5)


def rpc_rows(common: dict, draft: Path, gamma: int, n: int, device: str, cache_dir: Path) -> list[Row]:
    """The RPC device (server 1 thread, host 1 thread) holding every layer's non-expert weights
    and the expert pool, at each budget: static placement (llama.cpp's --n-cpu-moe: whole layers
    on the device, the first ones on the host) + speculative, and spac's default policy +
    speculative. Both draft on the host with the adaptive γ; only the placement differs."""
    from orchestrator.policies.static import StaticPlacement

    rows = []
    for budget in BUDGETS:
        cfg = SessionConfig(**{**common, "n_threads": 1, "expert_engine": True}, n_gpu_layers=-1, draft=draft, gamma=gamma,
                            pool=(PoolDevice(device or "CPU", Budget(ratio=budget)),), calibration_cache=cache_dir / f"cal-{budget}.json")
        rows.append(spac_row(f"RPC {budget:.0%} static + speculative", f"≤{gamma}", cfg, n, StaticPlacement))
        rows.append(spac_row(f"RPC {budget:.0%} spac default + speculative", f"≤{gamma}", cfg, n))
    return rows


# ------------------------------------------------------------------------------ the run

def _cpu_ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def machine_cpu_seconds() -> float:
    """CPU seconds (all processes, all cores) spent so far, from /proc/stat: user, nice, system, irq
    and softirq (not idle, iowait or the hypervisor's steal; guest time is counted in user)."""
    ticks = _cpu_ticks()
    return sum(ticks[i] for i in (0, 1, 2, 5, 6) if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def steal_seconds() -> float:
    """CPU seconds the hypervisor gave other guests (/proc/stat's steal, all CPUs): a virtual machine
    whose host is busy runs slower with no process of its own to show for it."""
    ticks = _cpu_ticks()
    return ticks[7] / os.sysconf("SC_CLK_TCK") if len(ticks) > 7 else 0.0


def own_cpu_seconds() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def run_rows(rows: list[Row], prompts: list[str]) -> None:
    runners = []
    try:
        for row in rows:
            runners.append(row.open())
        for prompt in prompts:
            for row, (run, _) in zip(rows, runners):
                t, s, text, d, a, st = run(prompt)
                r = row.result
                r.tokens += t
                r.seconds += s
                r.texts.append(text)
                r.drafted += d
                r.accepted += a
                r.steps += st
    finally:
        for _, close in runners:
            close()


def check_outputs(rows: list[Row]) -> list[str]:
    base = rows[0].result.texts
    problems = []
    for row in rows[1:]:
        for i, (ref, got) in enumerate(zip(base, row.result.texts)):
            same = got.startswith(ref) if row.prefix_ok else got == ref
            if row.lossless and not same:
                problems.append(f"{row.name} γ={row.gamma}: prompt {i} differs from autoregressive: "
                                f"{got[:80]!r} vs {ref[:80]!r}")
    return problems


def table(rows: list[Row], peer: Row | None) -> str:
    base = rows[0].result.tps
    lines = ["| row | γ | tok/s | × autoregressive | × llama.cpp | acceptance | tokens/step |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        r = row.result
        acc = f"{r.accepted / r.drafted:.3f}" if r.drafted else "—"
        per_step = f"{r.tokens / r.steps:.2f}" if r.steps else "—"
        vs_peer = f"{r.tps / peer.result.tps:.3f}" if peer is not None and row.gamma == peer.gamma else ""
        name = row.name + (f" ({row.note})" if row.note else "")
        lines.append(f"| {name} | {row.gamma} | {r.tps:.2f} | {r.tps / base:.3f} | {vs_peer} | {acc} | {per_step} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("-md", "--model-draft", type=Path)
    ap.add_argument("--draft-max", type=int, default=8, help="γ bound of the adaptive row; llama.cpp's γ")
    ap.add_argument("--gammas", default="1,2,4,8", help="fixed-γ spac rows (comma list; '' for none)")
    ap.add_argument("-n", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--no-llama", action="store_true", help="leave out llama.cpp's program")
    ap.add_argument("--rpc", action="store_true", help="add the RPC device rows (needs the overlapped engine)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    target, draft = args.model, args.model_draft
    if target is None or draft is None:
        default_target, default_draft = default_models()
        target, draft = target or default_target, draft or default_draft
    if target is None or draft is None:
        sys.exit("no default models (orchestrator/shipped_models/MANIFEST.json): pass -m and -md")
    n = args.n
    common = dict(model=target, n_ctx=args.ctx_size, n_threads=args.threads, expert_engine=False)
    rows = [spac_row("autoregressive", "—", SessionConfig(**common), n),
            spac_row("spac adaptive", f"≤{args.draft_max}", SessionConfig(**common, draft=draft, gamma=args.draft_max), n)]
    for g in [int(x) for x in args.gammas.split(",") if x.strip()]:
        rows.append(spac_row("spac fixed", str(g),
                             SessionConfig(**common, draft=draft, gamma=g, adaptive_gamma=False), n))
    peer = None
    if not args.no_llama:
        peer = llama_row(stock_program("llama-speculative-simple"), target, draft, args.draft_max, args.threads,
                         args.ctx_size, n)
        rows.append(peer)
    with contextlib.ExitStack() as stack:
        if args.rpc:
            from orchestrator.runtime.rpc import rpc_device  # the RPC server on 127.0.0.1, registered here

            device = stack.enter_context(rpc_device(n_threads=1))
            cache = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            rows += rpc_rows(common, draft, args.draft_max, n, device, cache)
        load0 = os.getloadavg()
        cpu0, own0, steal0, t0 = machine_cpu_seconds(), own_cpu_seconds(), steal_seconds(), time.monotonic()
        run_rows(rows, PROMPTS[:args.prompts])
        wall = time.monotonic() - t0
    other = (machine_cpu_seconds() - cpu0) - (own_cpu_seconds() - own0)
    steal = steal_seconds() - steal0
    n_cpu = os.cpu_count() or 1

    print(f"target {target.name}, draft {draft.name}, {args.prompts} prompts × {n} tokens, "
          f"{args.threads} threads, n_ctx {args.ctx_size}, greedy")
    print(table(rows, peer))
    print(f"machine: {n_cpu} cores; load average at start {load0[0]:.2f}; other processes used "
          f"{max(other, 0):.0f} CPU-s of {wall * n_cpu:.0f} during the {wall:.0f} s run "
          f"({100 * max(other, 0) / (wall * n_cpu):.0f}%); the hypervisor took {steal:.0f} CPU-s "
          f"({100 * steal / (wall * n_cpu):.0f}%, steal time)")
    problems = check_outputs(rows)
    print("outputs: every spac row identical to autoregressive" + ("; llama.cpp's starts with it" if peer else "")
          if not problems else "OUTPUT MISMATCH:\n  " + "\n  ".join(problems))
    if args.json:
        args.json.write_text(json.dumps({
            "target": str(target), "draft": str(draft), "n": n, "prompts": args.prompts, "threads": args.threads,
            "rows": [{"name": r.name, "gamma": r.gamma, "note": r.note, "tokens": r.result.tokens,
                      "seconds": r.result.seconds, "tps": r.result.tps, "drafted": r.result.drafted,
                      "accepted": r.result.accepted} for r in rows],
            "other_cpu_share": max(other, 0) / (wall * n_cpu)}, indent=1))
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
