"""Fidelity, routing and draft-acceptance report for the models of scripts/train_tiny_moe.py.

    python scripts/tiny_model_report.py --run runs/tiny --gguf runs/tiny/gguf

1. Fidelity: llama.cpp logits (F32 GGUF, F32 KV cache) vs PyTorch on held-out windows.
2. Routing (PyTorch, held-out windows): per-layer usage entropy, dead experts, and
   P(an expert chosen at token t is chosen again within t+1..t+w) vs a uniform random
   router and vs the same routing shuffled in time. Also writes a routing profile
   (usage counts on training text) and from it the hot-expert drafts draft-hot{N}-f16.gguf.
3. Greedy acceptance at gamma = 4 and 8 of each draft GGUF on held-out prompts: the target's
   greedy continuation is the reference; a step drafts gamma tokens from the accepted prefix,
   accepts the longest matching prefix, then takes the target's token.
4. The first run, beside a baseline target GGUF (`--baseline`, e.g. an earlier shipped model):
   held-out perplexity through llama.cpp over every held-out file (per token, per byte, and per
   token of the baseline's tokenizer, so models with different tokenizers compare), and
   greedy 64-token continuations of ten function and class headers (CODE_PROMPTS), each scored
   by whether its first complete top-level statement parses with `ast` and does something (a
   body that is more than literals, `pass` and a docstring).
Writes <run>/report.json and prints a summary.

    python scripts/tiny_model_report.py --run runs/tiny --baseline old-target-f16.gguf --only-first-run
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from train_tiny_moe import LM, eval_windows

from orchestrator import shipped_models
from orchestrator.gguf_files.hot_experts import hot_experts, slice_experts
from orchestrator.shipped_models import sha256_file


def load_torch(path: Path) -> LM:
    ck = torch.load(path, weights_only=True, map_location="cpu")
    m = LM(ck["config"])
    m.load_state_dict(ck["model"])
    return m.eval()


def load_llama(path: Path, n_ctx: int = 512, f32_kv: bool = True):
    return shipped_models.load_llama(path, n_ctx=n_ctx, f32_kv=f32_kv, n_threads=2)


def fidelity(model: LM, gguf_path: Path, windows: torch.Tensor) -> dict:
    llm = load_llama(gguf_path)
    max_rel, fro_rel, argmax_agree = [], [], []
    for w in windows:
        toks = w.tolist()
        with torch.no_grad():
            ref = model(w[None])[0][0].double().numpy()
        llm.reset()
        llm.eval(toks)
        got = np.asarray(llm.scores[: len(toks)], dtype=np.float64)
        d = np.abs(got - ref)
        max_rel.append(float(d.max() / np.abs(ref).max()))
        fro_rel.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
        argmax_agree.append(float((got.argmax(-1) == ref.argmax(-1)).mean()))
    del llm
    return dict(gguf=gguf_path.name, windows=len(windows), tokens_per_window=int(windows.shape[1]),
                max_abs_diff_over_max_abs_logit=max(max_rel), rel_frobenius=max(fro_rel),
                argmax_agreement=float(np.mean(argmax_agree)))


@torch.no_grad()
def routing_of(model: LM, windows: torch.Tensor) -> np.ndarray:
    """int64 [n_windows, T, n_layer, k]"""
    out = [model(windows[i:i + 16], with_routing=True)[2] for i in range(0, len(windows), 16)]
    return torch.cat(out).numpy()


def reuse_probability(sel: np.ndarray, n_expert: int, w: int) -> float:
    """P(expert chosen at t is chosen again in t+1..t+w), sel: [n_windows, T, k] for one layer."""
    n, T, _ = sel.shape
    onehot = np.zeros((n, T, n_expert), dtype=bool)
    np.put_along_axis(onehot, sel, True, axis=2)
    future = np.zeros((n, T - w, n_expert), dtype=bool)
    for s in range(1, w + 1):
        future |= onehot[:, s:T - w + s]
    now = onehot[:, : T - w]
    return float((now & future).sum() / now.sum())


def routing_report(model: LM, windows: torch.Tensor, seed: int = 0) -> dict:
    c = model.c
    E, k = c["n_expert"], c["n_expert_used"]
    sel = routing_of(model, windows)  # [n, T, L, k]
    rng = np.random.default_rng(seed)
    shuffled = sel[:, rng.permutation(sel.shape[1])]
    layers = []
    for layer in range(c["n_layer"]):
        counts = np.bincount(sel[:, :, layer].ravel(), minlength=E)
        p = counts / counts.sum()
        ent = float(-(p[p > 0] * np.log(p[p > 0])).sum() / math.log(E))
        row = dict(layer=layer, usage_entropy_norm=ent, dead_experts=int((counts == 0).sum()),
                   max_share=float(p.max()), min_share=float(p.min()))
        for w in (1, 8):
            row[f"reuse_{w}"] = reuse_probability(sel[:, :, layer], E, w)
            row[f"reuse_{w}_shuffled"] = reuse_probability(shuffled[:, :, layer], E, w)
            row[f"reuse_{w}_random_router"] = 1 - (1 - k / E) ** w
        layers.append(row)
    return dict(tokens=int(sel.shape[0] * sel.shape[1]), layers=layers)


@torch.no_grad()
def routing_profile(model: LM, windows: torch.Tensor) -> np.ndarray:
    sel = routing_of(model, windows)
    c = model.c
    prof = np.zeros((c["n_layer"], c["n_expert"]), dtype=np.int64)
    for layer in range(c["n_layer"]):
        prof[layer] = np.bincount(sel[:, :, layer].ravel(), minlength=c["n_expert"])
    return prof


def argmax_last(llm) -> int:
    return int(np.argmax(llm.scores[llm.n_tokens - 1]))


def greedy_continuation(target, prompt: list[int], n: int) -> list[int]:
    target.reset()
    target.eval(prompt)
    out = []
    for _ in range(n):
        out.append(argmax_last(target))
        target.eval([out[-1]])
    return out


def acceptance(draft, prompts: list[list[int]], conts: list[list[int]], gamma: int) -> dict:
    drafted = accepted = steps = produced = 0
    for prompt, cont in zip(prompts, conts):
        draft.reset()
        draft.eval(prompt)
        pos = 0
        while pos < len(cont):
            base, g = draft.n_tokens, min(gamma, len(cont) - pos)
            proposal = []
            for _ in range(g):
                proposal.append(argmax_last(draft))
                draft.eval([proposal[-1]])
            a = 0
            while a < g and proposal[a] == cont[pos + a]:
                a += 1
            drafted, accepted, steps = drafted + g, accepted + a, steps + 1
            draft.n_tokens = base  # roll back; eval() drops the KV cells past n_tokens
            draft.eval(cont[pos:pos + a + 1])
            produced += len(cont[pos:pos + a + 1])
            pos += a + 1
    return dict(gamma=gamma, acceptance=accepted / drafted, tokens_per_verify=produced / steps,
                drafted=drafted, accepted=accepted, verify_steps=steps)


def token_latency(llm, prompt: list[int], n: int = 16) -> float:
    llm.reset()
    llm.eval(prompt)
    t = time.perf_counter()
    for _ in range(n):
        llm.eval([argmax_last(llm)])
    return (time.perf_counter() - t) / n

# --- 4. the first run: held-out perplexity and code prompts, beside a baseline --------------------

CODE_PROMPTS = [  # in the style of the README's "def fibonacci(n):"; written for this report
    "def fibonacci(n):",
    "def add(a, b):",
    "def is_prime(n):",
    "def read_lines(path):",
    "def parse_args(argv=None):",
    "def reverse_words(text):",
    "def main():",
    "class Stack:",
    "class Point:",
    "class Config(object):",
]


def held_out_nll(gguf_path: Path, texts: list[str], n_ctx: int = 256) -> dict:
    """Next-token NLL (nats) of llama.cpp's logits over every held-out file, each tokenized by
    the GGUF's own tokenizer and ended by its end-of-text token, in windows of `n_ctx` tokens.
    Models with different tokenizers are compared on the same text: per byte, or per token of
    one of them (`ppl_per_token_of`)."""
    llm = load_llama(gguf_path, n_ctx=n_ctx)
    eot = llm.token_eos()
    ids = []
    for t in texts:
        ids += llm.tokenize(t.encode(), add_bos=False, special=False) + [eot]
    nll = 0.0
    for s in range(0, len(ids) - 1, n_ctx):
        w = ids[s:s + n_ctx + 1]
        llm.reset()
        llm.eval(w[:-1])
        logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= logp[np.arange(len(w) - 1), w[1:]].sum()
    del llm
    n_bytes = sum(len(t.encode()) for t in texts)
    return dict(nll=nll, tokens=len(ids) - 1, bytes=n_bytes, ppl=math.exp(nll / (len(ids) - 1)),
                bits_per_byte=nll / math.log(2) / n_bytes)


def _does_something(stmt: ast.stmt) -> bool:
    """False for a bare literal (`28166114...`, `1, 1, 1`), and for a def or class whose body is
    only literals (a docstring among them) and `pass`."""
    def literal(e: ast.expr) -> bool:  # 1, "s", (1, 1, 1), [0, 0]: what ast.literal_eval accepts
        try:
            ast.literal_eval(e)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False
        return True

    def trivial(s: ast.stmt) -> bool:
        return isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and literal(s.value))
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return not all(trivial(s) for s in stmt.body)
    return not trivial(stmt)


def first_statement(text: str) -> tuple[str, bool]:
    """The first complete top-level statement of `text`, and whether it parses and does something.

    The statement runs to the next non-blank line at column 0. If the text ends first (the
    continuation was cut), lines are dropped from its end until the rest parses: a cut in the
    middle of a line or of a block is not held against it, but what is left must do something."""
    lines = text.split("\n")
    end = next((i for i in range(1, len(lines)) if lines[i][:1].strip() and lines[i][0] != "#"), None)
    candidates = [lines[:end]] if end is not None else [lines[:k] for k in range(len(lines), 0, -1)]
    for cand in candidates:
        src = "\n".join(cand).rstrip()
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        return src, bool(tree.body) and _does_something(tree.body[0])
    return "\n".join(candidates[0] if candidates else lines).rstrip(), False


def code_prompts(gguf_path: Path, n_tokens: int = 64) -> list[dict]:
    llm = load_llama(gguf_path, n_ctx=128)
    rows = []
    for prompt in CODE_PROMPTS:
        toks = llm.tokenize(prompt.encode())
        cont = greedy_continuation(llm, toks, n_tokens)
        text = prompt + llm.detokenize(cont).decode("utf-8", errors="replace")
        stmt, ok = first_statement(text)
        rows.append(dict(prompt=prompt, ok=ok, statement=stmt, text=text))
    del llm
    return rows


def first_run_report(gguf_paths: dict[str, Path], held_out: list[str]) -> dict:
    """Section 4 for each GGUF. The first entry is the reference: every model's perplexity is
    also given per token of the reference's tokenizer (the same text's NLL over its token count)."""
    out = {}
    for name, path in gguf_paths.items():
        print(f"[first run] {name}: {path}", flush=True)
        rows = code_prompts(path)
        out[name] = dict(gguf=Path(path).name, sha256=sha256_file(path), held_out=held_out_nll(path, held_out),
                         code_prompts_ok=sum(r["ok"] for r in rows), code_prompts=rows)
    ref_name, ref = next(iter(out.items()))
    for r in out.values():
        r["held_out"]["ppl_per_token_of"] = ref_name
        r["held_out"]["ppl_per_ref_token"] = math.exp(r["held_out"]["nll"] / ref["held_out"]["tokens"])
    for name, r in out.items():
        for row in r["code_prompts"]:
            print(f"--- {name}, {'does something' if row['ok'] else 'no'}: {row['prompt']!r}\n{row['statement']}")
    print(f"held-out: {len(held_out)} files, {ref['held_out']['bytes']:,} bytes; perplexity per token of {ref_name!r}")
    print(f"{'model':<10} {'tokens':>8} {'ppl':>8} {'bits/byte':>10} {'ppl per ' + ref_name + ' token':>24} "
          f"{'code prompts':>13}")
    for name, r in out.items():
        h = r["held_out"]
        print(f"{name:<10} {h['tokens']:>8,} {h['ppl']:>8.2f} {h['bits_per_byte']:>10.3f} "
              f"{h['ppl_per_ref_token']:>24.2f} {r['code_prompts_ok']:>10}/{len(CODE_PROMPTS)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/tiny"))
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--cont-len", type=int, default=32)
    ap.add_argument("--drafts", nargs="*", default=None, help="draft GGUF names in --gguf (default: all)")
    ap.add_argument("--hot-keep", type=int, nargs="*", default=[8, 16], help="hot-expert drafts to make")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a target GGUF to report beside this run's in section 4 (e.g. the earlier shipped one)")
    ap.add_argument("--only-first-run", action="store_true", help="section 4 alone (no checkpoints needed)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    gdir = args.gguf or args.run / "gguf"
    z = np.load(next(args.run.glob("tokens-*.npz")))
    val, train = z["val"], z["train"]
    report_path = args.run / "report.json"
    first_run = {"this run": gdir / "target-f16.gguf"}
    if args.baseline:
        first_run = {"baseline": args.baseline, **first_run}
    corpus = json.loads((args.run / "corpus.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = [(stdlib / f["path"]).read_text("utf-8") for f in corpus["files"] if f["split"] == "val"]
    if args.only_first_run:
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        report["first_run"] = first_run_report(first_run, held_out)
        report_path.write_text(json.dumps(report, indent=1))
        return
    target = load_torch(args.run / "target.pt")
    report: dict = {}

    report["fidelity"] = [fidelity(target, gdir / name, eval_windows(val, 8, 128)) for name in
                          ("target-f32.gguf", "target-f16.gguf") if (gdir / name).exists()]
    print(json.dumps(report["fidelity"], indent=1), flush=True)

    report["routing"] = routing_report(target, eval_windows(val, 64, 256))
    for row in report["routing"]["layers"]:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    prof = routing_profile(target, eval_windows(train, 128, 256))
    np.save(args.run / "routing_profile.npy", prof)
    for n_keep in args.hot_keep:  # SpecMoE hot-expert self-drafts from the profile
        slice_experts(gdir / "target-f16.gguf", gdir / f"draft-hot{n_keep}-f16.gguf", hot_experts(prof, n_keep))

    starts = np.linspace(0, len(val) - args.prompt_len - 1, args.prompts).astype(int)
    prompts = [val[s:s + args.prompt_len].tolist() for s in starts]
    n_ctx = args.prompt_len + args.cont_len + 32
    tgt = load_llama(gdir / "target-f16.gguf", n_ctx=n_ctx, f32_kv=False)
    conts = [greedy_continuation(tgt, p, args.cont_len) for p in prompts]
    report["target_token_latency_ms"] = 1e3 * token_latency(tgt, prompts[0])
    tgt.reset()
    tgt.eval(prompts[0])
    t = time.perf_counter()
    for _ in range(8):
        tgt.n_tokens = len(prompts[0])
        tgt.eval(conts[0][:5])
    report["target_verify5_latency_ms"] = 1e3 * (time.perf_counter() - t) / 8
    del tgt
    names = args.drafts or sorted(p.name for p in gdir.glob("*.gguf") if p.name not in (
        "target-f32.gguf", "target-f16.gguf", "draft-dense-f32.gguf"))
    report["drafts"] = {}
    for name in names:
        d = load_llama(gdir / name, n_ctx=n_ctx, f32_kv=False)
        res = dict(size_mb=(gdir / name).stat().st_size / 1e6, token_latency_ms=1e3 * token_latency(d, prompts[0]),
                   by_gamma=[acceptance(d, prompts, conts, g) for g in (4, 8)])
        del d
        report["drafts"][name] = res
        print(name, json.dumps(res), flush=True)
    report["first_run"] = first_run_report(first_run, held_out)
    report_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
