"""Drafts side by side on one target: the pool draft (issue 17) at pool budgets 25/50/75 % beside
the Q4_0 self-draft, a hot-expert draft and no draft; and the pool draft's lookahead.

Each configuration runs in its own process (so its resident set is its own): greedy, the same
prompts, γ = 4, the expert pool on the test device (a second CPU buffer) unless --device.
Per row: acceptance rate, draft cost per drafted token relative to one target token (median
single-token decodes of each context, after the run), tokens/s, and extra memory (resident set
minus the no-draft run's at the same budget). The pool draft's lookahead: the share of the next
verify pass's expert selections that the unmasked router of that step's draft decodes chose,
beside the share the previous verify pass's selections predicted.

    .venv/bin/python bench/bench_drafts.py                 # shipped tiny target (models/)
    .venv/bin/python bench/bench_drafts.py -m T.gguf -md D.gguf --budgets 0.5
    .venv/bin/python bench/bench_drafts.py --memory        # issue 17's memory check, synthetic OLMoE shape

Timings mean something only on an idle machine (run it under `flock -x /tmp/spac-cpu.lock`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "def read_file(path):\n    with open(path) as f:",
           "# Parse the command line\nparser = argparse."]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def hit_rates(steps) -> tuple[float, float]:
    """(lookahead, previous step): share of each verify's (token, layer) selections predicted."""
    hit_la = hit_prev = total = 0
    prev = None
    for selected, lookahead in steps:  # selected [n_tok, n_layer, k]; lookahead: list of [n_layer, n, k]
        n_layer = selected.shape[1]
        la = [set(np.concatenate([a[m].ravel() for a in lookahead]).tolist()) if lookahead else set()
              for m in range(n_layer)]
        for m in range(n_layer):
            sel = selected[:, m, :].ravel()
            total += sel.size
            hit_la += sum(int(e) in la[m] for e in sel)
            if prev is not None:
                hit_prev += sum(int(e) in prev[m] for e in sel)
        prev = [set(selected[:, m, :].ravel().tolist()) for m in range(n_layer)]
    return hit_la / max(total, 1), hit_prev / max(total, 1)


def run_one(args) -> dict:
    """One configuration, in this process: prints one JSON line."""
    from orchestrator.runtime.calibrate import measure_draft
    from orchestrator.runtime.native import Routing
    from orchestrator.decoding.sampling import SamplingParams
    from orchestrator.decoding.speculative import POOL_DRAFT, Session, SessionConfig
    from orchestrator.runtime.pool import Budget, PoolDevice

    draft = {"none": None, "pool": POOL_DRAFT}.get(args.draft, args.draft)
    # a fixed γ: the drafts are compared at the same draft length (the governor would stop drafting
    # wherever a draft costs about as much as the target, as the pool draft does on a CPU "device")
    cfg = SessionConfig(model=args.model, draft=draft, gamma=args.gamma, adaptive_gamma=False, n_ctx=1024,
                        n_threads=args.threads, expert_engine=True, pool=(PoolDevice(args.device or "CPU", Budget(ratio=args.budget)),),
                        calibration_cache=Path(args.tmp) / f"cal-{Path(str(args.draft)).name}-{args.budget}.json")
    out: dict = {"draft": args.draft, "budget": args.budget}
    with Session(cfg) as s:
        s.complete(PROMPTS[0], max_tokens=8)  # warm-up
        n_tok = t = drafted = accepted = 0
        for p in PROMPTS[:args.prompts]:
            s.reset()
            s.complete(p, max_tokens=args.n, sampling=SamplingParams())
            m = s.last_metrics
            n_tok, t = n_tok + m.n_tokens, t + m.decode_s
            drafted, accepted = drafted + m.n_drafted, accepted + m.n_accepted
        out.update(tok_s=n_tok / max(t, 1e-9), acceptance=accepted / drafted if drafted else None,
                   rss=rss_bytes())
        if s.draft_ctx is not None:
            rng = np.random.default_rng(0)
            prefix = np.asarray(s.tokenize(PROMPTS[0]), np.int32)
            t_draft = measure_draft(s.draft_ctx, prefix, rng, n=16)
            t_target = measure_draft(s.ctx, prefix, rng, n=16)
            out["draft_cost"] = t_draft / t_target
            s.reset()
        if args.draft == "pool":  # lookahead, untimed: the unmasked router's choice while drafting
            droute = Routing(s.draft_ctx.ptr, s.engine.n_expert_used)
            lookahead, steps = [], []
            decode = s.draft_ctx.decode

            def traced(tokens, logits_all=True):
                decode(tokens, logits_all)
                lookahead.append(droute.unmasked())

            s.draft_ctx.decode = traced
            s.on_step = lambda r: (steps.append((r.selected, list(lookahead))), lookahead.clear())
            for p in PROMPTS[:args.prompts]:
                s.reset()
                lookahead.clear()
                s.complete(p, max_tokens=args.n, sampling=SamplingParams())
            out["lookahead_hit"], out["prev_step_hit"] = hit_rates(steps)
    return out


def memory_check(args) -> None:
    """Issue 17: resident set with the pool draft − without ≤ the draft's KV cache + 5 %."""
    if args.child:
        from orchestrator.runtime.llm import Context, Model
        from orchestrator.runtime.native import ExpertEngine

        model = Model(args.model, repack="off")
        ctx = Context(model, n_ctx=args.n_ctx, n_batch=64, n_threads=args.threads)
        engine = ExpertEngine(ctx.ptr, args.model, budget_ratio=args.budget)
        from orchestrator.policies.plan import Plan

        L, E = engine.n_moe_layers, engine.n_expert
        engine.set_plan(Plan(np.full((L, E), 4, np.uint8), np.ones(L, np.int32)))
        engine.wait_idle(600)
        tokens = list(range(10, 42))
        ctx.decode(tokens, logits_all=False)
        for t in range(8):
            ctx.decode([100 + t], logits_all=False)
        before = rss_bytes()
        out = {"rss_without": before}
        if args.draft == "pool":
            dctx = Context(model, n_ctx=args.n_ctx, n_batch=16, n_threads=args.threads)  # as Session makes it
            engine.attach_draft(dctx.ptr)
            dctx.decode(tokens, logits_all=False)
            for t in range(8):
                dctx.decode([100 + t], logits_all=False)
            out["rss_with"] = rss_bytes()
        n_layer = model.n_layer
        n_head_kv = int(model.meta(f"{model.arch}.attention.head_count_kv") or model.meta(f"{model.arch}.attention.head_count"))
        n_embd = int(model.meta(f"{model.arch}.embedding_length"))
        n_head = int(model.meta(f"{model.arch}.attention.head_count"))
        out["kv_bytes"] = args.n_ctx * n_layer * 2 * n_head_kv * (n_embd // n_head) * 2  # K and V, f16
        print(json.dumps(out))
        return
    model = Path(args.model or ROOT / "runs" / "synth" / "olmoe-4l-q4_0.gguf")
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), "olmoe-1b-7b", str(model),
                        "--n-layer", "4"], check=True)
    res = subprocess.run([sys.executable, __file__, "--memory", "--child", "-m", str(model), "--draft", "pool",
                          "--budget", str(args.budget), "--n-ctx", str(args.n_ctx), "-t", str(args.threads)],
                         capture_output=True, text=True, check=True)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    extra = r["rss_with"] - r["rss_without"]
    bound = r["kv_bytes"] * 1.05
    print(f"{model.name} (pool {args.budget:.0%}, n_ctx {args.n_ctx}): RSS without the pool draft "
          f"{r['rss_without'] / 2**20:.0f} MiB, with {r['rss_with'] / 2**20:.0f} MiB: extra {extra / 2**20:.1f} MiB; "
          f"draft KV cache {r['kv_bytes'] / 2**20:.1f} MiB (+5 %: {bound / 2**20:.1f} MiB) -> "
          f"{'OK' if extra <= bound else 'OVER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("-md", "--model-draft", help="the Q4_0 self-draft [default: the shipped one]")
    ap.add_argument("--budgets", default="0.25,0.5,0.75")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--memory", action="store_true", help="the memory check on a synthetic OLMoE-shape file")
    ap.add_argument("--n-ctx", type=int, default=4096)
    # one configuration in this process (used by the parent)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--draft", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0.5, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory:
        memory_check(args)
        return
    if args.child:
        print(json.dumps(run_one(args)))
        return

    from orchestrator.cli.setup import default_models

    target, shipped_draft = default_models()
    target = Path(args.model) if args.model else target
    q4 = Path(args.model_draft) if args.model_draft else shipped_draft
    budgets = [float(b) for b in args.budgets.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        hot = make_hot_draft(target, Path(tmp), args.threads)
        rows = []
        for budget in budgets:
            for name, draft in (("none", "none"), ("q4_0", str(q4)), ("hot", str(hot)), ("pool", "pool")):
                cmd = [sys.executable, __file__, "--child", "-m", str(target), "--draft", draft, "--budget", str(budget),
                       "--gamma", str(args.gamma), "-n", str(args.n), "--prompts", str(args.prompts),
                       "-t", str(args.threads), "--tmp", tmp] + (["--device", args.device] if args.device else [])
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"{name} @ {budget:.0%}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                r["name"] = name
                rows.append(r)
        print(f"target {target.name}, γ={args.gamma}, {args.prompts} prompts x {args.n} tokens, greedy, "
              f"pool on {args.device or 'CPU (test device)'}, {args.threads} threads")
        print(f"{'draft':6} {'pool':>5} {'accept':>7} {'cost/tok':>9} {'tok/s':>7} {'vs none':>8} {'extra MiB':>10} "
              f"{'lookahead hit':>14} {'prev-step hit':>14}")
        for budget in budgets:
            base = next((r for r in rows if r["name"] == "none" and r["budget"] == budget), None)
            for r in (r for r in rows if r["budget"] == budget):
                acc = f"{r['acceptance']:.2f}" if r.get("acceptance") is not None else "-"
                cost = f"{r['draft_cost']:.2f}" if "draft_cost" in r else "-"
                rel = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
                extra = f"{(r['rss'] - base['rss']) / 2**20:.1f}" if base else "-"
                la = f"{r['lookahead_hit']:.2f}" if "lookahead_hit" in r else "-"
                prev = f"{r['prev_step_hit']:.2f}" if "prev_step_hit" in r else "-"
                print(f"{r['name']:6} {budget:>5.0%} {acc:>7} {cost:>9} {r['tok_s']:>7.1f} {rel:>8} {extra:>10} "
                      f"{la:>14} {prev:>14}")


def make_hot_draft(target: Path, d: Path, threads: int) -> Path:
    """SpecMoE-style draft: per layer the quarter of experts the target uses most on the prompts."""
    from orchestrator.gguf_files.gguf_export import read_config
    from orchestrator.gguf_files.hot_experts import hot_experts, slice_experts
    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import Routing

    cfg = read_config(target)
    model = Model(target, repack="off")
    ctx = Context(model, n_ctx=1024, n_batch=256, n_threads=threads)
    routing = Routing(ctx.ptr, cfg.n_expert_used)
    counts = np.zeros((cfg.n_layer, cfg.n_expert), np.int64)
    try:
        for p in PROMPTS:
            ctx.clear()
            toks = model.tokenize(p, add_special=True)
            ctx.decode(toks, logits_all=False)
            for _ in range(32):
                t = int(ctx.logits()[-1].argmax())
                ctx.decode([t], logits_all=False)
                ids = routing.last()[0]
                for m in range(ids.shape[0]):
                    np.add.at(counts[m], ids[m].ravel(), 1)
    finally:
        ctx.close()
        model.close()
    keep = max(cfg.n_expert_used, cfg.n_expert // 4)
    return slice_experts(target, d / "hot.gguf", hot_experts(counts, keep))


if __name__ == "__main__":
    main()
