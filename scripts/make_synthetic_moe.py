"""Shape-faithful synthetic MoE GGUFs for scale tests: random Q4_0 weights with the real
dimensions of named models, written tensor by tensor (never the whole model in RAM).

    python scripts/make_synthetic_moe.py olmoe-1b-7b runs/synth/olmoe-q4_0.gguf
    python scripts/make_synthetic_moe.py qwen3-30b-a3b runs/synth/qwen3-30b-4l.gguf --n-layer 4
    python scripts/make_synthetic_moe.py olmoe-1b-7b out.gguf --check   # then load it, generate, report peak RSS
    python scripts/make_synthetic_moe.py qwen3.6-35b-a3b runs/synth/qwen36-4l.gguf --n-layer 4   # a hybrid:
        # gated-delta-net layers (a recurrent state, no KV cache) and every 4th layer full attention
    python scripts/make_synthetic_moe.py qwen3.6-35b-a3b runs/synth/qwen36-4l-mtp-f16.gguf --n-layer 4 \
        --mtp-layers 1 --dtype f16   # with its MTP layer (--draft mtp), F16 (spac draft quantized makes a Q4_0 draft)

Weights are random 4-bit blocks of mean zero (per-block scale giving std 1/sqrt(fan_in)), norms
are ones (a delta net's decay rates negative, its conv kernel F32 floats, as the converter keeps
it): the numbers mean nothing, the shapes, sizes and kernels are the real ones, and so is the
spread of a prompt's routing over the experts. --uniform-nibbles writes the earlier files, whose
weights have mean -0.5 scale: from the second MoE layer on every token of a prompt picks the same
experts (a prefill then multiplies 8 experts by every token instead of all of them by a few).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.gguf_files.gguf_export import byte_level_bpe_tokenizer, write_gguf
from orchestrator.gguf_files.synthetic_models import PRESETS, synthetic_tensors


def check(path: Path, n_tokens: int = 16) -> dict:
    """Load in a fresh process, generate greedily, report load/generation time and peak RSS."""
    code = f"""
import json, resource, time
from orchestrator.shipped_models import load_llama
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
         mtp_layers: int = typer.Option(0, help="MTP layers after the trunk (qwen35moe: 0 or 1), for --draft mtp"),
         dtype: str = typer.Option("q4_0", help="q4_0 | f16 (normal floats: a file llama.cpp can quantize)"),
         seed: int = typer.Option(0), run_check: bool = typer.Option(False, "--check"),
         uniform_nibbles: bool = typer.Option(False, "--uniform-nibbles",
                                              help="the earlier weights (mean -0.5 scale: degenerate routing)")):
    if preset not in PRESETS:
        typer.echo(f"error: unknown preset {preset!r}; expected one of {sorted(PRESETS)}", err=True)
        raise typer.Exit(2)
    if dtype not in ("q4_0", "f16"):
        typer.echo(f"error: --dtype {dtype!r}; expected q4_0 or f16", err=True)
        raise typer.Exit(2)
    cfg = replace(PRESETS[preset], n_layer=n_layer or PRESETS[preset].n_layer, n_mtp=mtp_layers)
    try:
        cfg.check()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    tensors = synthetic_tensors(cfg, seed, zero_mean=not uniform_nibbles, floats=dtype == "f16")
    t0 = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"{preset} {dtype.upper()}", total=len(tensors))
        write_gguf(out, cfg, tensors, byte_level_bpe_tokenizer(cfg.n_vocab), dtype=dtype,
                   metadata={"spac.synthetic": preset}, progress=lambda name: bar.advance(task))
    size = out.stat().st_size
    typer.echo(f"wrote {out}: {size / 2**30:.2f} GiB in {time.time() - t0:.0f}s "
               f"(writer peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    if run_check:
        typer.echo(json.dumps(check(out)))


if __name__ == "__main__":
    app()
