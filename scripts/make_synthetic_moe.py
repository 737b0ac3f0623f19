"""Shape-faithful synthetic MoE GGUFs for scale tests: random Q4_0 weights with the real
dimensions of named models, written tensor by tensor (never the whole model in RAM).

    python scripts/make_synthetic_moe.py olmoe-1b-7b runs/synth/olmoe-q4_0.gguf
    python scripts/make_synthetic_moe.py qwen3-30b-a3b runs/synth/qwen3-30b-4l.gguf --n-layer 4
    python scripts/make_synthetic_moe.py olmoe-1b-7b out.gguf --check   # then load it, generate, report peak RSS

Weights are random 4-bit blocks (uniform nibbles, per-block scale giving std 1/sqrt(fan_in)),
norms are ones: the numbers mean nothing, the shapes, sizes and kernels are the real ones.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.gguf_export import (  # noqa: E402
    ModelConfig,
    byte_level_bpe_tokenizer,
    tensor_shapes,
    write_gguf,
)

# Dimensions from the models' published configs.
PRESETS: dict[str, ModelConfig] = {
    "olmoe-1b-7b": ModelConfig(
        arch="olmoe", n_vocab=50304, n_embd=2048, n_layer=16, n_head=16, n_head_kv=16, head_dim=128,
        n_ff=1024, n_expert=64, n_expert_used=8, n_ff_exp=1024, n_ctx_train=4096, rope_freq_base=10000.0,
        rms_norm_eps=1e-5, name="synthetic-OLMoE-1B-7B"),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3moe", n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
        n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx_train=40960, rope_freq_base=1e6,
        rms_norm_eps=1e-6, name="synthetic-Qwen3-30B-A3B"),
}

Q4_0_BLOCK = 32
NIBBLE_STD = float(np.sqrt(((np.arange(16) - 8.0) ** 2).mean()))  # std of (q - 8), q uniform in 0..15


def random_q4_0(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_0 blocks (f16 scale + 16 bytes of nibbles) for a float tensor of `shape`."""
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    blocks = np.empty((rows, n // Q4_0_BLOCK, 18), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(std / NIBBLE_STD).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, n // Q4_0_BLOCK, 16), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], n // Q4_0_BLOCK * 18)


def synthetic_tensors(cfg: ModelConfig, seed: int) -> dict:
    def make(name: str, shape: tuple[int, ...], i: int):
        def f():
            if len(shape) == 1:
                return np.ones(shape, np.float32)
            rng = np.random.default_rng([seed, i])
            return random_q4_0(shape, shape[-1] ** -0.5 if "token_embd" not in name else 1.0, rng)
        return f
    return {n: make(n, s, i) for i, (n, s) in enumerate(tensor_shapes(cfg).items())}


def check(path: Path, n_tokens: int = 16) -> dict:
    """Load in a fresh process, generate greedily, report load/generation time and peak RSS."""
    code = f"""
import json, resource, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from orchestrator.models import load_llama
t = time.time(); llm = load_llama({str(path)!r}, n_ctx=128, n_threads=2); t_load = time.time() - t
toks = llm.tokenize(b"def main():")
t = time.time(); llm.eval(toks)
for _ in range({n_tokens}):
    llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
t_gen = time.time() - t
print(json.dumps(dict(load_s=t_load, generate_s=t_gen, tokens={n_tokens},
                      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


app = typer.Typer(add_completion=False)


@app.command()
def main(preset: str = typer.Argument(..., help=" | ".join(PRESETS)), out: Path = typer.Argument(...),
         n_layer: int = typer.Option(None, help="fewer layers than the real model"),
         seed: int = typer.Option(0), run_check: bool = typer.Option(False, "--check")):
    if preset not in PRESETS:
        typer.echo(f"error: unknown preset {preset!r}; expected one of {sorted(PRESETS)}", err=True)
        raise typer.Exit(2)
    cfg = PRESETS[preset] if n_layer is None else replace(PRESETS[preset], n_layer=n_layer)
    tensors = synthetic_tensors(cfg, seed)
    t0 = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{preset} Q4_0", total=len(tensors))
        write_gguf(out, cfg, tensors, byte_level_bpe_tokenizer(cfg.n_vocab), dtype="q4_0",
                   metadata={"spac.synthetic": preset}, progress=lambda name: bar.advance(task))
    size = out.stat().st_size
    typer.echo(f"wrote {out}: {size / 2**30:.2f} GiB in {time.time() - t0:.0f}s "
               f"(writer peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    if run_check:
        typer.echo(json.dumps(check(out)))


if __name__ == "__main__":
    app()
