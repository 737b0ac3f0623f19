"""Tokens/s of speculative vs autoregressive decoding on the same target and engine, one run.

Both modes use one configuration (target, threads, expert pool, budget); the autoregressive run
is the "--no-sd" ablation. Greedy decoding, the same prompts for both, alternated prompt by
prompt so that machine load hits both alike. Prints tokens/s of each and their ratio.

    .venv/bin/python bench/bench_speculative.py                      # default models (manifest)
    .venv/bin/python bench/bench_speculative.py -m T.gguf -md D.gguf --gamma 4 -n 64 --prompts 4
    .venv/bin/python bench/bench_speculative.py --random             # seeded random tiny models
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from orchestrator.cli.setup import default_models
from orchestrator.decoding.sampling import SamplingParams
from orchestrator.decoding.speculative import Session, SessionConfig
from orchestrator.runtime.pool import Budget, PoolDevice
from orchestrator.policies.spac import Ablations

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "def read_file(path):\n    with open(path) as f:",
           "    return sorted(items, key=", "# Parse the command line\nparser = argparse.", "try:\n    import json"]


def random_models(d: Path) -> tuple[Path, Path]:
    from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

    cfg = tiny_config("qwen3moe", n_layer=4, n_embd=128, n_expert=16, n_expert_used=4, n_ff_exp=64, n_head=4,
                      head_dim=32)
    return (make_random_model(d / "target.gguf", cfg, seed=1),
            make_random_model(d / "draft-q4_0.gguf", cfg, seed=1, quant="q4_0"))


def run(session: Session, prompt: str, n: int) -> tuple[int, float]:
    session.reset()
    session.complete(prompt, max_tokens=n, sampling=SamplingParams())
    m = session.last_metrics
    return m.n_tokens, m.decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("--random", action="store_true", help="seeded random tiny models instead of the defaults")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.25, help="pool size as a share of all experts")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    if args.random:
        target, draft = random_models(Path(tmp.name))
    elif args.model:
        target, draft = Path(args.model), Path(args.model_draft) if args.model_draft else None
    else:
        target, draft = default_models()
        if target is None:
            sys.exit("no default models (orchestrator/shipped_models/MANIFEST.json): pass -m/-md or --random")
    if draft is None:
        sys.exit("a draft model is needed (-md)")

    def config(no_sd: bool) -> SessionConfig:
        return SessionConfig(model=target, draft=draft, gamma=args.gamma, n_threads=args.threads,
                             expert_engine=False if args.no_engine else None, pool=(PoolDevice("CPU", Budget(ratio=args.budget)),),
                             calibration_cache=Path(tmp.name) / "cal.json", ablations=Ablations(no_sd=no_sd))

    spec, ar = Session(config(False)), Session(config(True))
    try:
        for s in (spec, ar):  # warm-up
            run(s, PROMPTS[0], 8)
        totals = {"speculative": [0, 0.0], "autoregressive": [0, 0.0]}
        accept = []
        for prompt in PROMPTS[:args.prompts]:
            for name, s in (("speculative", spec), ("autoregressive", ar)):
                n, dt = run(s, prompt, args.n)
                totals[name][0] += n
                totals[name][1] += dt
                if s is spec:
                    accept.append(s.last_metrics.acceptance_rate or 0.0)
        tps = {k: n / dt for k, (n, dt) in totals.items()}
        result = {"target": Path(target).name, "draft": Path(draft).name, "gamma": args.gamma,
                  "engine": spec.engine is not None, "tokens_per_s_speculative": round(tps["speculative"], 2),
                  "tokens_per_s_autoregressive": round(tps["autoregressive"], 2),
                  "ratio": round(tps["speculative"] / tps["autoregressive"], 3),
                  "acceptance_rate": round(float(np.mean(accept)), 3),
                  "tokens_per_step": spec.last_metrics.tokens_per_step}
    finally:
        spec.close()
        ar.close()
        tmp.cleanup()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['target']} + {result['draft']}, γ={args.gamma}, engine {'on' if result['engine'] else 'off'}: "
              f"speculative {result['tokens_per_s_speculative']:.1f} tok/s, autoregressive "
              f"{result['tokens_per_s_autoregressive']:.1f} tok/s, ratio {result['ratio']:.2f} "
              f"(acceptance {result['acceptance_rate']:.2f})")


if __name__ == "__main__":
    main()
