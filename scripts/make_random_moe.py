"""Write a seeded random-weight GGUF (qwen3moe, qwen3 or qwen2moe) for tests and benchmarks.

    python scripts/make_random_moe.py out.gguf --arch qwen2moe --n-layer 2 --dtype f32
    python scripts/make_random_moe.py out-q4.gguf --n-expert 16 --quant q4_0
"""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.gguf_files.gguf_export import make_random_model, tiny_config

app = typer.Typer(add_completion=False)


@app.command()
def main(
    out: Path = typer.Argument(..., help="GGUF file to write"),
    arch: str = typer.Option("qwen3moe", help="qwen3moe | qwen3 | qwen2moe"),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("f32", help="f32 | f16 | q8_0 | q4_0 (written directly)"),
    quant: str = typer.Option(None, help="re-quantize through llama.cpp, e.g. q4_0, q4_k_m"),
    n_vocab: int = typer.Option(None), n_embd: int = typer.Option(None), n_layer: int = typer.Option(None),
    n_head: int = typer.Option(None), n_head_kv: int = typer.Option(None), head_dim: int = typer.Option(None),
    n_ff: int = typer.Option(None), n_expert: int = typer.Option(None), n_expert_used: int = typer.Option(None),
    n_ff_exp: int = typer.Option(None), n_ff_shexp: int = typer.Option(None),
) -> None:
    overrides = {k: v for k, v in dict(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=n_ff, n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp).items() if v is not None}
    try:
        cfg = tiny_config(arch, **overrides)
        path = make_random_model(out, cfg, seed=seed, dtype=dtype, quant=quant)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path} ({path.stat().st_size} bytes): {cfg.to_json()}")


if __name__ == "__main__":
    app()
