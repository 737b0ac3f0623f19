"""Split logits against unsplit ones on a real device, per engine setting: the GPU counterpart of
the bit-identical tests (which run on the CPU test device and the RPC device).

    python bench/device_split_check.py -m MODEL.gguf --device CUDA0 [--budgets 0.25,0.5] [--plans 6]

The model's layers all on the device (-ngl 99); the reference is the same context with no pool
(every expert on the device). Then, for each budget × split graph × join, an engine is attached,
a few random plans are applied (waiting for their copies), and a fixed decode sequence (an
8-token ubatch, then single tokens) is compared with the reference: the largest difference
relative to the largest logit, NaN/Inf, and the graph's crossings. Exit 1 when a setting computes
NaN/Inf or differs by more than --tol.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from engine_common import PROMPT, model_config  # noqa: E402  (the engine tests' ubatch and random model)

NEXT = [12, 200, 3, 77, 150]


def run_sequence(ctx) -> np.ndarray:
    ctx.clear()
    ctx.decode(PROMPT, logits_all=True)
    out = [ctx.logits().copy()]
    for t in NEXT:
        ctx.decode([t])
        out.append(ctx.logits().copy())
    return np.concatenate([o.reshape(-1, o.shape[-1]) for o in out])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("--device", default="CUDA0")
    ap.add_argument("--budgets", default="0.25,0.5")
    ap.add_argument("--plans", type=int, default=6)
    ap.add_argument("-t", "--threads", type=int, default=4)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="layers on the device (0: on the host)")
    ap.add_argument("--settings", type=int, default=3, help="how many of the split graph × join settings to run")
    ap.add_argument("--random", metavar="QUANT", help="a random 4-layer qwen3moe model of this type instead of -m")
    ap.add_argument("--tol", type=float, default=1e-2, help="largest |split − unsplit| / max |unsplit| accepted")
    args = ap.parse_args()

    from orchestrator.runtime.llm import Context, Model
    from orchestrator.runtime.native import ExpertEngine, graph_n_crossings
    from orchestrator.policies.plan import Plan

    if args.random:
        import tempfile

        from orchestrator.gguf_files.gguf_export import make_random_model

        args.model = make_random_model(Path(tempfile.mkdtemp()) / f"random-{args.random}.gguf", model_config("qwen3moe"),
                                       seed=2, dtype="f32", quant=args.random)
    model = Model(args.model, n_gpu_layers=args.n_gpu_layers, repack="off")
    ctx = Context(model, n_ctx=128, n_batch=16, n_threads=args.threads)
    bad = 0
    try:
        ref = run_sequence(ctx)
        again = run_sequence(ctx)
        scale = float(np.abs(ref).max())
        print(f"{Path(args.model).name} on {args.device}, -ngl {args.n_gpu_layers}: reference finite={np.isfinite(ref).all()}, "
              f"repeat differs by {np.abs(again - ref).max() / scale:.2e}")
        for budget in (float(b) for b in args.budgets.split(",")):
            settings = (("overlap", "auto"), ("overlap", "per-expert"), ("per-matmul", "auto"))
            for split_graph, join in settings[:args.settings]:
                rng = np.random.default_rng(0)
                worst, finite = 0.0, True
                with ExpertEngine(ctx.ptr, args.model, device=args.device, budget_ratio=budget,
                                  split_graph=split_graph, join=join) as engine:
                    L, E = engine.n_moe_layers, engine.n_expert
                    for _ in range(args.plans):
                        engine.set_plan(Plan(rng.integers(0, 5, (L, E)).astype(np.uint8), np.full(L, 2, np.int32)))
                        assert engine.wait_idle(60)
                        got = run_sequence(ctx)
                        finite &= bool(np.isfinite(got).all())
                        worst = max(worst, float(np.nanmax(np.abs(got - ref))) / scale)
                    stats = engine.stats()
                    crossings = graph_n_crossings(ctx.ptr)
                ok = finite and worst <= args.tol
                bad += not ok
                print(f"  budget {budget:.0%} {split_graph:10s} join {join:10s}: max rel diff {worst:.2e} "
                      f"finite={finite} crossings={crossings} resident={stats['n_resident']} "
                      f"device tokens={stats['n_expert_tokens_device']} {'ok' if ok else 'BAD'}", flush=True)
    finally:
        ctx.close()
        model.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
