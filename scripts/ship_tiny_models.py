"""Copy the trained tiny models into orchestrator/shipped_models/ (package data) and write its MANIFEST.json.

    python scripts/ship_tiny_models.py --run runs/tiny

Needs <run>/metrics.json (train_tiny_moe.py), <run>/report.json (tiny_model_report.py) and
the GGUFs of export_tiny_models.py. The default draft is the one with the best estimated
speed-up at gamma = 4: tokens per verify step / (gamma * draft token time + verify time).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from orchestrator.shipped_models import MODELS_DIR, sha256_file

SHIPPED = {  # file in <run>/gguf -> (file in orchestrator/shipped_models/, role, description)
    "target-f16.gguf": ("spac-tiny-moe-f16.gguf", "target",
                        "qwen3moe target, 6 layers, d 256, 32 experts of ff 64, top-4, F16"),
    "target-q4_0.gguf": ("spac-tiny-moe-q4_0.gguf", "draft-quantized",
                         "quantized self-draft (MoE-SpeQ): the target through llama.cpp's Q4_0 quantizer"),
    "draft-dense-f16.gguf": ("spac-tiny-dense-draft-f16.gguf", "draft-dense",
                             "dense qwen3 draft, same tokenizer, distilled from the target, F16"),
}
MAX_BYTES = 30 * 10**6


def speedup(d: dict, verify_ms: float, target_ms: float, gamma: int = 4) -> float:
    g = next(x for x in d["by_gamma"] if x["gamma"] == gamma)
    return g["tokens_per_verify"] * target_ms / (gamma * d["token_latency_ms"] + verify_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/tiny"))
    ap.add_argument("--out", type=Path, default=MODELS_DIR)
    args = ap.parse_args()
    metrics = json.loads((args.run / "metrics.json").read_text())
    report = json.loads((args.run / "report.json").read_text())
    corpus = json.loads((args.run / "corpus.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)

    files, est = [], {}
    for src, (dst, role, desc) in SHIPPED.items():
        p = args.run / "gguf" / src
        if p.stat().st_size > MAX_BYTES:
            raise SystemExit(f"{src} is {p.stat().st_size / 1e6:.1f} MB, over the 30 MB limit")
        shutil.copyfile(p, args.out / dst)
        entry = dict(file=dst, role=role, description=desc, bytes=p.stat().st_size, sha256=sha256_file(p))
        if src in report["drafts"]:
            d = report["drafts"][src]
            entry["greedy_acceptance"] = {f"gamma_{g['gamma']}": round(g["acceptance"], 4) for g in d["by_gamma"]}
            entry["tokens_per_verify"] = {f"gamma_{g['gamma']}": round(g["tokens_per_verify"], 3)
                                          for g in d["by_gamma"]}
            entry["token_latency_ms"] = round(d["token_latency_ms"], 3)
            est[role] = speedup(d, report["target_verify5_latency_ms"], report["target_token_latency_ms"])
            entry["estimated_speedup_gamma_4"] = round(est[role], 3)
        files.append(entry)

    t, d = metrics["target"], metrics["draft"]
    fid = next(f for f in report["fidelity"] if f["gguf"] == "target-f32.gguf")
    man = dict(
        default_draft=max(est, key=est.get),
        files=files,
        other_drafts_measured={k: dict(greedy_acceptance={f"gamma_{g['gamma']}": round(g["acceptance"], 4)
                                                          for g in v["by_gamma"]}, size_mb=round(v["size_mb"], 2))
                               for k, v in report["drafts"].items() if k not in SHIPPED},
        training=dict(
            command=metrics["command"] + f"; python scripts/export_tiny_models.py --run {args.run}; "
                    f"python scripts/tiny_model_report.py --run {args.run} --baseline PREVIOUS-TARGET.gguf; "
                    f"python scripts/ship_tiny_models.py --run {args.run}",
            seed=metrics["config"]["seed"], wall_seconds=round(metrics["wall_seconds"]),
            target=dict(params=t["params"], steps=metrics["config"]["max_steps"], train_seconds=round(t["train_seconds"]),
                        held_out_loss=round(t["val_loss"], 4), held_out_ppl=round(t["val_ppl"], 2)),
            draft=dict(params=d["params"], steps=metrics["config"]["draft_steps"], train_seconds=round(d["train_seconds"]),
                       held_out_loss=round(d["val_loss"], 4), held_out_ppl=round(d["val_ppl"], 2),
                       distill_weight=metrics["config"]["draft_distill"]),
            unigram_held_out_ppl=round(math.exp(metrics["unigram_val_loss"]), 1),
            held_out_eval=f"{metrics['config']['final_eval_windows']} evenly spaced windows of "
                          f"{metrics['config']['seq_len']} tokens of the held-out split",
        ),
        corpus=dict(
            source=corpus["source"], fingerprint=corpus["fingerprint"],
            files_train=sum(f["split"] == "train" for f in corpus["files"]),
            files_held_out=sum(f["split"] == "val" for f in corpus["files"]),
            bytes_train=sum(f["bytes"] for f in corpus["files"] if f["split"] == "train"),
            bytes_held_out=sum(f["bytes"] for f in corpus["files"] if f["split"] == "val"),
            tokens_train=metrics["tokens_train"], tokens_held_out=metrics["tokens_val"],
        ),
        fidelity=dict(f32_gguf_vs_pytorch_max_rel=fid["max_abs_diff_over_max_abs_logit"],
                      argmax_agreement=fid["argmax_agreement"], kv_cache="F32"),
        routing=report["routing"]["layers"],
    )
    if "first_run" in report:  # tiny_model_report.py --baseline: this model beside the one it replaces
        man["first_run"] = dict(
            baseline="the target shipped before this one (PREVIOUS-TARGET.gguf: its sha256 is below)",
            held_out="every held-out file, in windows of 256 tokens, through llama.cpp; ppl per token of "
                     "the first model's tokenizer = the same text's NLL over that model's token count",
            code_prompts="greedy 64-token continuations; ok = the first complete top-level statement parses "
                         "with ast and does something (tiny_model_report.first_statement)",
            models={name: dict(gguf=r["gguf"], sha256=r["sha256"],
                               held_out_tokens=r["held_out"]["tokens"],
                               held_out_ppl=round(r["held_out"]["ppl"], 2),
                               bits_per_byte=round(r["held_out"]["bits_per_byte"], 4),
                               ppl_per_token_of_first=round(r["held_out"]["ppl_per_ref_token"], 2),
                               code_prompts_ok=f"{r['code_prompts_ok']}/{len(r['code_prompts'])}",
                               code_prompts={row["prompt"]: row["ok"] for row in r["code_prompts"]})
                    for name, r in report["first_run"].items()})
    (args.out / "MANIFEST.json").write_text(json.dumps(man, indent=1) + "\n")
    print(json.dumps({k: man[k] for k in ("default_draft", "training")}, indent=1))


if __name__ == "__main__":
    main()
