"""Train spac's default models: a tiny Qwen3-MoE target and a dense Qwen3 draft.

One file, nanoGPT style: the configuration is the dataclass below; any field can be
overridden on the command line (`--max-steps 20 --out runs/smoke`). Everything is seeded.

Corpus: every `*.py` file of the running CPython's standard library (sysconfig "stdlib",
site-packages excluded), i.e. files present on any machine with the same Python. A file is
held out when sha256 of its path relative to the stdlib falls in the lowest `val_percent`
of the hash range. The exact list (path, bytes, sha256, split) is written to
`<out>/corpus.json` and its fingerprint into the checkpoint.

Output in `<out>/`: tokenizer.json, target.pt, draft.pt, corpus.json, metrics.json.
`scripts/export_tiny_models.py` turns the checkpoints into GGUF.

    python scripts/train_tiny_moe.py                       # full run (~75 min on an idle 2-core machine)
    python scripts/train_tiny_moe.py --max-steps 30 --draft-steps 10 --out runs/smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TrainConfig:
    out: str = "runs/tiny"
    seed: int = 1234
    threads: int = 2  # idle 2-core machine: 0.70 s/step, 1 thread 1.21; on a loaded one 1 thread is faster (OpenMP spins)
    # corpus and tokenizer
    val_percent: float = 5.0
    vocab_size: int = 4096
    pre_tokenizer: str = "starcoder"  # a key of PRE_TOKENIZERS: the GGUF's tokenizer.ggml.pre
    # target: qwen3moe
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 64
    aux_loss_coef: float = 0.01
    # draft: qwen3 (dense), same tokenizer, distilled from the target
    draft_n_layer: int = 2
    draft_n_ff: int = 768
    draft_distill: float = 0.5  # weight of KL(target || draft); 0 = plain next-token training
    # shared
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-6
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 5500
    draft_steps: int = 500
    eval_every: int = 500
    eval_windows: int = 64  # during training
    final_eval_windows: int = 256


EOT = "<|endoftext|>"
# Pre-tokenizer splits, applied in order, each as llama.cpp applies them for tokenizer.ggml.pre.
# "starcoder" (a code model's): every digit alone, and punctuation never takes the newline after
# it, so "):" is the same token at the end of a prompt ("def f(n):") as in the middle of a file,
# and a newline with the next line's indentation is one piece. "qwen2" glues newlines to the
# punctuation before them ("):\n"): 97% of "):" in the stdlib is that token, the lone "):" a
# prompt ends in is always followed by more of the same line, and the first shipped model
# (stop 34 and before) continued "def fibonacci(n):" on the same line with digits.
PRE_TOKENIZERS = {
    "starcoder": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "qwen2": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


# --- corpus ------------------------------------------------------------------------------------

def corpus_files(cfg: TrainConfig) -> tuple[Path, list[dict]]:
    """Every stdlib *.py (site-packages excluded) that decodes as UTF-8, with its split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or not p.is_file():
            continue
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
        split = "val" if h < cfg.val_percent / 100 * 2**32 else "train"
        files.append(dict(path=rel, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), split=split))
    return root, files


def fingerprint(files: list[dict]) -> str:
    return hashlib.sha256(json.dumps([(f["path"], f["sha256"], f["split"]) for f in files]).encode()).hexdigest()


def pre_tokenizer(name: str):
    """The `tokenizers` pre-tokenizer that splits as llama.cpp does for tokenizer.ggml.pre = name."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[name]),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(cfg: TrainConfig, root: Path, files: list[dict]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer(cfg.pre_tokenizer)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = ((root / f["path"]).read_text("utf-8") for f in files if f["split"] == "train")
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenize_split(tok, root: Path, files: list[dict], split: str) -> np.ndarray:
    eot = tok.token_to_id(EOT)
    texts = [(root / f["path"]).read_text("utf-8") for f in files if f["split"] == split]
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def load_corpus(cfg: TrainConfig, out: Path):
    """Tokenizer and token arrays, cached in `out` for the same corpus fingerprint."""
    from tokenizers import Tokenizer

    t0 = time.time()
    root, files = corpus_files(cfg)
    fp = fingerprint(files)
    print(f"[corpus] {len(files)} files of the CPython {sys.version.split()[0]} standard library "
          f"({time.time() - t0:.0f}s)", flush=True)
    cache = out / f"tokens-{fp[:12]}-{cfg.vocab_size}-{cfg.pre_tokenizer}.npz"
    if cache.exists() and (out / "tokenizer.json").exists():
        print(f"[corpus] tokenizer and tokens from {cache.name}", flush=True)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        z = np.load(cache)
        return tok, z["train"], z["val"], files, fp
    print(f"[corpus] training a {cfg.vocab_size}-token BPE ({cfg.pre_tokenizer} split) on the train split", flush=True)
    tok = train_tokenizer(cfg, root, files)
    tok.save(str(out / "tokenizer.json"))
    print(f"[corpus] tokenizing ({time.time() - t0:.0f}s)", flush=True)
    train, val = tokenize_split(tok, root, files, "train"), tokenize_split(tok, root, files, "val")
    np.savez(cache, train=train, val=val)
    print(f"[corpus] {len(train):,} train and {len(val):,} held-out tokens ({time.time() - t0:.0f}s)", flush=True)
    (out / "corpus.json").write_text(json.dumps(dict(
        source=f"CPython {sys.version.split()[0]} standard library, every *.py except site-packages, "
               f"UTF-8 only; held out: sha256(relative path) in the lowest {cfg.val_percent}% of the range",
        fingerprint=fp, files=files), indent=0))
    return tok, train, val, files, fp


def batch(data: np.ndarray, n: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - seq_len - 1, (n,), generator=gen).numpy()
    x = np.stack([data[i:i + seq_len + 1] for i in ix]).astype(np.int64)
    x = torch.from_numpy(x)
    return x[:, :-1], x[:, 1:]


def eval_windows(data: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """`n` evenly spaced fixed windows (seq_len + 1 tokens): the same every run."""
    starts = np.linspace(0, len(data) - seq_len - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64))


# --- model (mirrors llama.cpp's qwen3moe / qwen3 graphs) ----------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # x * rsqrt(mean(x^2) + eps) * weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """x: (B, H, T, hd). NEOX rotation: dims i and i + hd/2 form a pair (HF rotate_half)."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])
    ang = pos.float()[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        d, hd = c["n_embd"], c["head_dim"]
        self.wq = nn.Linear(d, c["n_head"] * hd, bias=False)
        self.wk = nn.Linear(d, c["n_head_kv"] * hd, bias=False)
        self.wv = nn.Linear(d, c["n_head_kv"] * hd, bias=False)
        self.wo = nn.Linear(c["n_head"] * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x, pos):
        B, T, _ = x.shape
        c = self.c
        q = self.q_norm(self.wq(x).view(B, T, c["n_head"], c["head_dim"])).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(B, T, c["n_head_kv"], c["head_dim"])).transpose(1, 2)
        v = self.wv(x).view(B, T, c["n_head_kv"], c["head_dim"]).transpose(1, 2)
        q, k = rope_neox(q, pos, c["rope_freq_base"]), rope_neox(k, pos, c["rope_freq_base"])
        rep = c["n_head"] // c["n_head_kv"]  # query head h reads kv head h // rep (as ggml)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MoE(nn.Module):
    """Softmax router over all experts, top-k, weights renormalised over the chosen k."""

    def __init__(self, c: dict):
        super().__init__()
        E, d, f = c["n_expert"], c["n_embd"], c["n_ff_exp"]
        self.k = c["n_expert_used"]
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, f, d) * 0.02)
        self.w_up = nn.Parameter(torch.randn(E, f, d) * 0.02)
        self.w_down = nn.Parameter(torch.randn(E, d, f) * 0.02 / math.sqrt(2 * c["n_layer"]))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1)
        weights, selected = probs.topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # group the (token, slot) pairs by expert: one gather, one matmul chain per expert, one scatter
        E = self.w_gate.shape[0]
        order = selected.flatten().argsort(stable=True)
        tok = order // self.k
        counts = torch.bincount(selected.flatten(), minlength=E).tolist()
        ys = []
        for e, h in enumerate(x[tok].split(counts)):
            if h.shape[0]:
                ys.append((F.silu(h @ self.w_gate[e].T) * (h @ self.w_up[e].T)) @ self.w_down[e].T)
        y = torch.cat(ys) * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add(0, tok, y.to(x.dtype))
        frac = torch.bincount(selected.flatten(), minlength=E).float() / selected.numel()
        aux = E * (frac * probs.mean(0)).sum()  # Switch-style load balancing
        return out.view(shape), aux, selected.view(*shape[:-1], self.k)


class DenseFFN(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.gate = nn.Linear(c["n_embd"], c["n_ff"], bias=False)
        self.up = nn.Linear(c["n_embd"], c["n_ff"], bias=False)
        self.down = nn.Linear(c["n_ff"], c["n_embd"], bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)), x.new_zeros(()), None


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.attn_norm = RMSNorm(c["n_embd"], c["rms_norm_eps"])
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c["n_embd"], c["rms_norm_eps"])
        self.ffn = MoE(c) if c["arch"] == "qwen3moe" else DenseFFN(c)

    def forward(self, x, pos):
        x = x + self.attn(self.attn_norm(x), pos)
        y, aux, selected = self.ffn(self.ffn_norm(x))
        return x + y, aux, selected


class LM(nn.Module):
    """Token embedding tied with the output head (llama.cpp reuses token_embd when output is absent)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["n_vocab"], c["n_embd"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.norm = RMSNorm(c["n_embd"], c["rms_norm_eps"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c["n_layer"]) if name.endswith(("wo.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, with_routing: bool = False):
        pos = torch.arange(idx.shape[1])
        x = self.embed(idx)
        aux, routing = x.new_zeros(()), []
        for b in self.blocks:
            x, a, sel = b(x, pos)
            aux = aux + a
            routing.append(sel)
        logits = self.norm(x) @ self.embed.weight.T
        if with_routing:  # (B, T, n_layer, k)
            return logits, aux / len(self.blocks), torch.stack(routing, dim=2)
        return logits, aux / len(self.blocks)


def model_dict(cfg: TrainConfig, n_vocab: int, draft: bool) -> dict:
    c = dict(n_vocab=n_vocab, n_embd=cfg.n_embd, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
             head_dim=cfg.head_dim, rope_freq_base=cfg.rope_freq_base, rms_norm_eps=cfg.rms_norm_eps)
    if draft:
        return dict(c, arch="qwen3", n_layer=cfg.draft_n_layer, n_ff=cfg.draft_n_ff)
    return dict(c, arch="qwen3moe", n_layer=cfg.n_layer, n_expert=cfg.n_expert,
                n_expert_used=cfg.n_expert_used, n_ff_exp=cfg.n_ff_exp)


# --- training ---------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: LM, windows: torch.Tensor, bs: int = 16) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), bs):
        w = windows[i:i + bs]
        logits, _ = model(w[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n += w[:, 1:].numel()
    model.train()
    return total / n


def lr_at(cfg: TrainConfig, step: int, max_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train(cfg: TrainConfig, model: LM, train_data, val_windows, steps: int, tag: str,
          teacher: LM | None = None) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=cfg.weight_decay),
                             dict(params=no_decay, weight_decay=0.0)], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed + (1 if teacher else 0))
    log, t0 = [], time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step, steps)
        x, y = batch(train_data, cfg.batch_size, cfg.seq_len, gen)
        logits, aux = model(x)
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss = ce + cfg.aux_loss_coef * aux
        if teacher is not None and cfg.draft_distill > 0:
            with torch.no_grad():
                t_logits, _ = teacher(x)
            kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), F.log_softmax(t_logits, -1).flatten(0, 1),
                          log_target=True, reduction="batchmean")
            loss = (1 - cfg.draft_distill) * ce + cfg.draft_distill * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            el = time.time() - t0
            print(f"[{tag}] step {step}/{steps} ce {ce.item():.4f} aux {aux.item():.3f} "
                  f"lr {lr_at(cfg, step, steps):.2e} {el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)
        if (step + 1) % cfg.eval_every == 0 or step == steps - 1:
            v = evaluate(model, val_windows)
            log.append(dict(step=step + 1, val_loss=v, seconds=time.time() - t0))
            print(f"[{tag}] step {step + 1} held-out loss {v:.4f} ppl {math.exp(v):.2f}", flush=True)
    return log


def unigram_loss(train_data: np.ndarray, val_data: np.ndarray, n_vocab: int) -> float:
    counts = np.bincount(train_data, minlength=n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_data].mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    cfg = TrainConfig(**vars(ap.parse_args(argv)))
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.threads))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    tok, train_data, val_data, files, fp = load_corpus(cfg, out)
    n_vocab = tok.get_vocab_size()
    n_train = sum(f["bytes"] for f in files if f["split"] == "train")
    print(f"corpus {len(files)} files, {n_train / 1e6:.1f} MB train; tokens train {len(train_data):,} "
          f"val {len(val_data):,}; vocab {n_vocab}; {time.time() - t_start:.0f}s", flush=True)
    val_windows = eval_windows(val_data, cfg.eval_windows, cfg.seq_len)
    final_windows = eval_windows(val_data, cfg.final_eval_windows, cfg.seq_len)
    command = "python scripts/train_tiny_moe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    metrics = dict(config=dataclasses.asdict(cfg), command=command.strip(), corpus_fingerprint=fp,
                   tokens_train=int(len(train_data)), tokens_val=int(len(val_data)),
                   unigram_val_loss=unigram_loss(train_data, val_data, n_vocab))

    for draft in (False, True):
        tag = "draft" if draft else "target"
        c = model_dict(cfg, n_vocab, draft)
        torch.manual_seed(cfg.seed + (7 if draft else 0))
        model = LM(c)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{tag}] {c['arch']} {n_params / 1e6:.2f}M params", flush=True)
        teacher = None
        if draft and cfg.draft_distill > 0:
            teacher = LM(model_dict(cfg, n_vocab, False))
            teacher.load_state_dict(torch.load(out / "target.pt", weights_only=True)["model"])
            teacher.eval()
        t0 = time.time()
        log = train(cfg, model, train_data, val_windows, cfg.draft_steps if draft else cfg.max_steps, tag, teacher)
        val = evaluate(model, final_windows)
        metrics[tag] = dict(arch=c["arch"], params=n_params, train_seconds=time.time() - t0, log=log,
                            val_loss=val, val_ppl=math.exp(val))
        torch.save(dict(model=model.state_dict(), config=c, corpus_fingerprint=fp,
                        tokenizer_pre=cfg.pre_tokenizer), out / f"{tag}.pt")
        print(f"[{tag}] final held-out loss {val:.4f} ppl {math.exp(val):.2f} "
              f"in {time.time() - t0:.0f}s", flush=True)
    metrics["wall_seconds"] = time.time() - t_start
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"done in {metrics['wall_seconds']:.0f}s; unigram ppl {math.exp(metrics['unigram_val_loss']):.1f}")


if __name__ == "__main__":
    main()
