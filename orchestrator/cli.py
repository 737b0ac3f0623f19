"""`spac`: generate and chat with an MoE GGUF through speculative decoding and the expert pool.

    spac generate "def fibonacci(n):" -n 64 [--json]
    spac chat
    spac calibrate

Options follow llama.cpp's names (-m, -md, --draft-max, -t, -c, --temp, --seed, ...). With no
-m, the shipped default models (models/MANIFEST.json, `orchestrator.models`) are used; -m naming
the shipped target without -md takes the shipped default draft. Without a draft, decoding is
autoregressive. A bad model path is one line on stderr and exit code 2.

Other teams' command groups are mounted in `_mount_subcommands` (`spac sim`, `spac trace`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

app = typer.Typer(name="spac", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Speculative decoding for MoE GGUF models with a device expert pool.")
err = Console(stderr=True, highlight=False)


EXIT_USAGE = 2


# ----------------------------------------------------------------------------- default models

def default_models(models_dir: Path | None = None) -> tuple[Path | None, Path | None]:
    """(target, default draft) of the shipped models (`orchestrator.models`), or (None, None)
    when there is no manifest; the draft is None if the manifest names none."""
    from orchestrator import models

    models_dir = models_dir or models.MODELS_DIR
    try:
        target = models.default_model("target", models_dir)
    except (OSError, KeyError, ValueError):
        return None, None
    try:
        draft = models.default_model("draft", models_dir)
    except (KeyError, ValueError):
        draft = None
    return target, draft


# ----------------------------------------------------------------------------- options

def parse_budget(text: str | None) -> tuple[int, float]:
    """--expert-budget: "25%" → (0, 0.25); "512M", "2GiB", "123456" → (bytes, 0)."""
    if text is None:
        return 0, 0.25
    s = text.strip().upper()
    if s.endswith("%"):
        return 0, float(s[:-1]) / 100.0
    m = re.fullmatch(r"([0-9.]+)\s*([KMGT]?)(I?B)?", s)
    if not m:
        raise typer.BadParameter(f"expected bytes (e.g. 512M, 2G) or a percentage (25%), got {text!r}")
    scale = 1024 if m.group(3) == "IB" else 1000
    power = " KMGT".index(m.group(2) or " ")
    return int(float(m.group(1)) * scale**power), 0.0


ModelOpt = Annotated[Optional[Path], typer.Option("-m", "--model", help="target MoE GGUF [default: models/MANIFEST.json]")]
DraftOpt = Annotated[Optional[Path], typer.Option("-md", "--model-draft", help="draft GGUF (same vocabulary)")]
DraftMaxOpt = Annotated[int, typer.Option("--draft-max", help="γ, draft tokens per verification step")]
BudgetOpt = Annotated[Optional[str], typer.Option("--expert-budget", help="device pool: bytes (512M, 2G) or % of all experts [25%]")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="pool device: CPU (a second CPU buffer) or a ggml device name (CUDA0, ...)")]
ThreadsOpt = Annotated[int, typer.Option("-t", "--threads", help="CPU threads")]
CtxOpt = Annotated[int, typer.Option("-c", "--ctx-size", help="context size, 0 = the model's")]
TempOpt = Annotated[float, typer.Option("--temp", help="temperature, 0 = greedy")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="top-k, 0 = off")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="top-p, 1 = off")]
SeedOpt = Annotated[int, typer.Option("--seed", help="RNG seed, -1 = random")]
NglOpt = Annotated[int, typer.Option("-ngl", "--n-gpu-layers", help="target layers on the GPU (non-expert weights)")]
EngineOpt = Annotated[Optional[bool], typer.Option("--engine/--no-engine", help="expert pool on/off [on when built]")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="stop string (repeatable)")]
RecalOpt = Annotated[bool, typer.Option("--recalibrate", help="measure the unit costs again")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="llama.cpp logs")]
NoUtility = Annotated[bool, typer.Option("--no-utility", help="ablation: binary utility (K = 1)")]
NoAdabc = Annotated[bool, typer.Option("--no-adabc", help="ablation: fixed boundaries θ↑=3, θ↓=1")]
NoBalancer = Annotated[bool, typer.Option("--no-balancer", help="ablation: fixed τ = 2")]
NoPrefetch = Annotated[bool, typer.Option("--no-prefetch", help="ablation: static expert placement")]
NoEvict = Annotated[bool, typer.Option("--no-evict", help="ablation: keep experts until the pool is full")]
NoSd = Annotated[bool, typer.Option("--no-sd", help="ablation: autoregressive decoding on the same engine")]

_DEFAULT_THREADS = max(1, min(os.cpu_count() or 1, 8))


def _config(model, model_draft, draft_max, expert_budget, device, threads, ctx_size, n_gpu_layers, engine,
            recalibrate, verbose, ablations):
    from orchestrator.speculative import SessionConfig

    if model is None:
        target, draft = default_models()
        if target is None:
            _fail("no model given (-m) and no shipped default models (models/MANIFEST.json is missing)")
        model = target
        if model_draft is None:
            model_draft = draft
    elif model_draft is None:
        target, draft = default_models()
        if target is not None and model.resolve() == target.resolve():
            model_draft = draft
    budget_bytes, budget_ratio = parse_budget(expert_budget)
    return SessionConfig(model=model, draft=model_draft, gamma=draft_max, n_ctx=ctx_size, n_threads=threads,
                         n_gpu_layers=n_gpu_layers, engine=engine, device=device, budget_bytes=budget_bytes,
                         budget_ratio=budget_ratio, ablations=ablations, recalibrate=recalibrate, verbose=verbose)


def _open_session(cfg):
    """Session or one clear line and exit 2 (missing/non-GGUF file, vocab mismatch, engine)."""
    from orchestrator.llm import ModelError
    from orchestrator.native import NativeError
    from orchestrator.speculative import Session

    try:
        return Session(cfg)
    except (ModelError, NativeError, ValueError) as e:
        _fail(str(e))


def _fail(message: str) -> None:
    sys.stderr.write(f"spac: error: {' '.join(message.split())}\n")  # one line, never wrapped
    raise typer.Exit(EXIT_USAGE)


def _ablations(no_utility, no_adabc, no_balancer, no_prefetch, no_evict, no_sd):
    from orchestrator.speculative import Ablations

    return Ablations(no_utility=no_utility, no_adabc=no_adabc, no_balancer=no_balancer,
                     no_prefetch=no_prefetch, no_evict=no_evict, no_sd=no_sd)


def _sampling(temp, top_k, top_p, seed):
    from orchestrator.sampling import SamplingParams

    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=None if seed < 0 else seed)


def _describe(session) -> str:
    parts = [session.target.path.name]
    if session.draft is not None:
        parts.append(f"draft {session.draft.path.name}, γ={session.gamma}")
    else:
        parts.append("autoregressive")
    if session.engine is not None:
        st = session.engine.stats()
        parts.append(f"expert pool {st['n_slots']} slots on {session.cfg.device or 'CPU'}")
    elif session.engine_note:
        parts.append(session.engine_note)
    if session.cfg.ablations.names():
        parts.append("ablations: " + ", ".join(session.cfg.ablations.names()))
    return "; ".join(parts)


# ----------------------------------------------------------------------------- commands

@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt text")],
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate")] = 128,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object (text and metrics)")] = False,
    model: ModelOpt = None, model_draft: DraftOpt = None, draft_max: DraftMaxOpt = 8,
    expert_budget: BudgetOpt = None, device: DeviceOpt = None, threads: ThreadsOpt = _DEFAULT_THREADS,
    ctx_size: CtxOpt = 0, temp: TempOpt = 0.8, top_k: TopKOpt = 40, top_p: TopPOpt = 0.95, seed: SeedOpt = -1,
    n_gpu_layers: NglOpt = 0, engine: EngineOpt = None, stop: StopOpt = None, recalibrate: RecalOpt = False,
    verbose: VerboseOpt = False, no_utility: NoUtility = False, no_adabc: NoAdabc = False,
    no_balancer: NoBalancer = False, no_prefetch: NoPrefetch = False, no_evict: NoEvict = False, no_sd: NoSd = False,
) -> None:
    """Generate a continuation of PROMPT."""
    from orchestrator.llm import ModelError

    session = _open_session(_config(model, model_draft, draft_max, expert_budget, device, threads, ctx_size,
                                    n_gpu_layers, engine, recalibrate, verbose,
                                    _ablations(no_utility, no_adabc, no_balancer, no_prefetch, no_evict, no_sd)))
    sampling = _sampling(temp, top_k, top_p, seed)
    try:
        if not json_out:
            err.print(f"[dim]{_describe(session)}[/]", soft_wrap=True)
        chunks = session.generate(prompt, n_predict, stop or (), sampling)
        try:
            for chunk in chunks:
                if not json_out:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            chunks.close()
        except ModelError as e:
            _fail(str(e))
        m = session.last_metrics
        if json_out:
            out = {"text": session.last_text, "model": str(session.target.path),
                   "draft": str(session.draft.path) if session.draft is not None else None,
                   "engine": session.engine is not None, **m.to_dict()}
            sys.stdout.write(json.dumps(out) + "\n")
        else:
            sys.stdout.write("\n")
            err.print(f"[dim]{m.summary()}[/]", soft_wrap=True)
    finally:
        session.close()


@app.command()
def chat(
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="max tokens per answer")] = 256,
    system: Annotated[Optional[str], typer.Option("--system", help="system message")] = None,
    model: ModelOpt = None, model_draft: DraftOpt = None, draft_max: DraftMaxOpt = 8,
    expert_budget: BudgetOpt = None, device: DeviceOpt = None, threads: ThreadsOpt = _DEFAULT_THREADS,
    ctx_size: CtxOpt = 0, temp: TempOpt = 0.8, top_k: TopKOpt = 40, top_p: TopPOpt = 0.95, seed: SeedOpt = -1,
    n_gpu_layers: NglOpt = 0, engine: EngineOpt = None, stop: StopOpt = None, recalibrate: RecalOpt = False,
    verbose: VerboseOpt = False, no_utility: NoUtility = False, no_adabc: NoAdabc = False,
    no_balancer: NoBalancer = False, no_prefetch: NoPrefetch = False, no_evict: NoEvict = False, no_sd: NoSd = False,
) -> None:
    """Interactive chat, streamed. Ctrl-C stops an answer; Ctrl-C at the prompt (or Ctrl-D) exits.

    /reset forgets the conversation, /exit leaves."""
    from orchestrator.llm import ModelError

    session = _open_session(_config(model, model_draft, draft_max, expert_budget, device, threads, ctx_size,
                                    n_gpu_layers, engine, recalibrate, verbose,
                                    _ablations(no_utility, no_adabc, no_balancer, no_prefetch, no_evict, no_sd)))
    sampling = _sampling(temp, top_k, top_p, seed)
    console = Console(highlight=False)
    first = [{"role": "system", "content": system}] if system else []
    messages = list(first)
    try:
        console.print(f"[dim]{_describe(session)}[/]")
        if session.chat_template is None:
            console.print("[dim]no chat template in the model: the conversation is one running text[/]")
        console.print("[dim]Ctrl-C stops an answer, Ctrl-C at the prompt or Ctrl-D exits, /reset, /exit[/]")
        while True:
            try:
                line = console.input("[bold green]> [/]")
            except (KeyboardInterrupt, EOFError):
                console.print()
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                messages = list(first)
                session.reset()
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                answer = _answer(console, session, messages, n_predict, stop or (), sampling)
                if not console.is_terminal:  # a terminal's Live leaves the cursor on a new line
                    console.print()
            except KeyboardInterrupt:  # before the first token: back to the prompt all the same
                console.print("[dim]interrupted[/]")
                answer = ""
            messages.append({"role": "assistant", "content": answer})
    finally:
        session.close()
        console.print("[dim]bye[/]")


def _answer(console: Console, session, messages, n_predict, stop, sampling) -> str:
    """Stream one answer under a live status line; Ctrl-C ends it early."""
    from orchestrator.llm import ModelError

    text = ""

    def view(status: str) -> Group:
        return Group(Text(text), Text(status, style="dim"))

    def status_line() -> str:
        s = session.recorder.live()
        parts = [f"{s['n_tokens']} tok", f"{s['tokens_per_s']:.1f} tok/s"]
        if s["acceptance_rate"] is not None:
            parts.append(f"accept {s['acceptance_rate']:.2f}")
        if s["device_share"] is not None:
            parts.append(f"device {s['device_share']:.0%}")
        return " | ".join(parts)

    try:
        tokens = session.chat_tokens(messages)
    except (ModelError, ValueError) as e:
        console.print(f"[red]{e}[/]")
        return ""
    chunks = session.generate(tokens, n_predict, stop, sampling)
    with Live(view("..."), console=console, refresh_per_second=8, transient=False) as live:
        try:
            for chunk in chunks:
                text += chunk
                live.update(view(status_line()))
        except KeyboardInterrupt:
            chunks.close()
            live.update(view(status_line() + " | interrupted"))
            return text
        except ModelError as e:
            live.update(view(f"error: {e}"))
            return text
        live.update(view(session.last_metrics.summary()))
    return text


@app.command()
def calibrate(
    model: ModelOpt = None, model_draft: DraftOpt = None, draft_max: DraftMaxOpt = 8,
    expert_budget: BudgetOpt = None, device: DeviceOpt = None, threads: ThreadsOpt = _DEFAULT_THREADS,
    ctx_size: CtxOpt = 0, verbose: VerboseOpt = False,
) -> None:
    """Measure the unit costs of the workload balancer again and print them as JSON."""
    from dataclasses import asdict

    from orchestrator.speculative import Ablations

    session = _open_session(_config(model, model_draft, draft_max, expert_budget, device, threads, ctx_size, 0,
                                    True, True, verbose, Ablations()))
    try:
        sys.stdout.write(json.dumps(asdict(session.calibration), indent=1) + "\n")
    finally:
        session.close()


def _mount_subcommands() -> None:
    """Command groups owned by other parts of spac, mounted when their module exists:
    `spac sim ...`, `spac trace ...` (orchestrator.sim.cli) and `spac draft ...` (orchestrator.drafts)."""
    for name, module, attr in (("sim", "orchestrator.sim.cli", "app"), ("trace", "orchestrator.sim.cli", "trace_app"),
                               ("draft", "orchestrator.drafts", "app")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        sub = getattr(mod, attr, None)
        if sub is not None:
            app.add_typer(sub, name=name)


_mount_subcommands()

if __name__ == "__main__":
    app()
