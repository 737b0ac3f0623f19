"""Make a self-draft of a MoE GGUF: `spac draft ...` (also `python scripts/make_draft.py ...`).

    # MoE-SpeQ: a low-bit copy of the target
    spac draft quantized target.gguf draft-q4_0.gguf --type q4_0

    # SpecMoE: same architecture, keeping per layer the N experts most used in a routing profile
    spac draft hot-experts target.gguf draft-hot8.gguf --profile usage.npy --keep 8

A routing profile is a .npy of expert usage counts int [n_layer, n_expert], or a .npz with
"selected" int [n_tokens, n_layer, top_k] (the routing of verify passes, as in StepRouting).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from orchestrator.cli.options import check_output, fail
from orchestrator.runtime.llm import ModelError, check_gguf, init_backend
from orchestrator.gguf_files.gguf_export import quantize_gguf, read_config
from orchestrator.gguf_files.hot_experts import hot_experts, slice_experts

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Make a self-draft of a MoE GGUF: a low-bit copy (MoE-SpeQ) or its most-used experts (SpecMoE).")


def load_profile(path: Path, n_expert: int) -> np.ndarray:
    if path.suffix == ".npz":
        sel = np.load(path)["selected"]
        if sel.ndim != 3:
            raise ValueError(f"'selected' must be [n_tokens, n_layer, top_k], got {sel.shape}")
        prof = np.zeros((sel.shape[1], n_expert), dtype=np.int64)
        for layer in range(sel.shape[1]):
            prof[layer] = np.bincount(sel[:, layer].ravel(), minlength=n_expert)[:n_expert]
        return prof
    return np.load(path)


ForceOpt = typer.Option(False, "--force", help="overwrite DST if it exists (never the source)")


def _check_source(src: Path) -> None:
    try:
        check_gguf(src)
    except ModelError as e:
        fail(str(e))


@app.command()
def quantized(src: Path, dst: Path, type: str = typer.Option("q4_0", "--type", help="q4_0, q8_0, q4_k_m, ..."),
              force: bool = ForceOpt):
    """Low-bit copy of the target through llama.cpp's quantizer (written to a temporary file,
    then renamed: DST is whole or untouched)."""
    _check_source(src)
    check_output(dst, force, inputs=[src])
    init_backend()  # llama.cpp's errors only
    try:
        out = quantize_gguf(src, dst, type)
    except ValueError as e:
        fail(f"--type: {e}")
    except RuntimeError:
        fail(f"llama.cpp's quantizer could not read {src} (corrupt or unsupported GGUF); {dst} was not written")
    except OSError as e:
        fail(f"cannot write {dst}: {e.strerror or e}")
    typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


@app.command("hot-experts")
def hot_experts_cmd(src: Path, dst: Path, profile: Path = typer.Option(..., help=".npy counts or .npz routing"),
                    keep: int = typer.Option(..., help="experts kept per layer"), force: bool = ForceOpt):
    """Keep per layer the `keep` most-used experts; router rows sliced to match."""
    _check_source(src)
    check_output(dst, force, inputs=[src, profile])
    try:
        cfg = read_config(src)
        prof = load_profile(profile, cfg.n_expert)
        if prof.shape != (cfg.n_layer, cfg.n_expert):
            raise ValueError(f"profile shape {prof.shape} != (n_layer, n_expert) = {(cfg.n_layer, cfg.n_expert)}")
        ids = hot_experts(prof, keep)
        covered = [prof[i, k].sum() / max(1, prof[i].sum()) for i, k in enumerate(ids)]
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn()) as bar:
            task = bar.add_task("writing", total=src.stat().st_size)
            out = slice_experts(src, dst, ids, progress=lambda name, n: bar.advance(task, n))
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {dst}: {e.strerror or e}")
    typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB); kept {keep}/{cfg.n_expert} experts per layer, "
               f"covering {min(covered):.0%}..{max(covered):.0%} of the profiled routing")


if __name__ == "__main__":
    app()
