"""`spac`: generate and chat with an MoE GGUF through speculative decoding and the expert pool.

    spac generate "def fibonacci(n):" -n 64 [--json]
    spac chat
    spac calibrate
    spac serve --port 8080      (orchestrator.server)
    spac rpc-server -p 50052    (this machine's device for --rpc elsewhere; orchestrator.runtime.rpc)

Options follow llama.cpp's names (-m, -md, --spec-draft-n-max, -t, -c, -p, -f, --temp, --seed,
...); the block shared by generate, chat and calibrate (and serve) is declared once in
`orchestrator.cli.options`. With no -m, the shipped default models (orchestrator/shipped_models/MANIFEST.json) are used;
-m naming the shipped target (or a copy of it) without -md takes the shipped default draft.
Without a draft, decoding is autoregressive. Bad input is one line on stderr and exit code 2;
Ctrl-C is `stop: interrupted` and exit code 130.

The `spac sim`, `spac trace` and `spac draft` groups come from their modules, mounted at the end.

Why ~450 lines: five commands (generate, chat, calibrate, serve, rpc-server), --json's report
and chat's interactive loop (live status, Ctrl-C handling); the shared options are options.py,
what they make setup.py, the server server/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from orchestrator.cli import drafts, profile_measure, record
from orchestrator.cli.options import EXIT_INTERRUPTED, RunOptions, default_threads, fail, run_options
from orchestrator.cli.setup import open_session, session_setup
from orchestrator.decoding.speculative import EXACT_ROWS, Session
from orchestrator.runtime import progress, rpc
from orchestrator.runtime.host_layout import set_batch_invariant_rows
from orchestrator.runtime.llm import ModelError, deferred_sigint, sigint_noted
from orchestrator.runtime.native import NativeError
from orchestrator.sim import cli as sim_cli

__all__ = ["app", "main"]

app = typer.Typer(name="spac", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Speculative decoding for MoE GGUF models with a device expert pool.")
err = Console(stderr=True, highlight=False)


# ----------------------------------------------------------------------------- helpers

def _clean(text: str) -> str:
    """Text from argv, a file or stdin as valid UTF-8: bytes a shell in another locale passed
    through (surrogate escapes) become U+FFFD instead of failing the tokenizer."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _read_prompt(prompt: str | None, prompt_opt: str | None, file: Path | None) -> str:
    """PROMPT, -p/--prompt or -f/--file (exactly one); "-" as PROMPT or FILE reads stdin."""
    given = [x for x in (prompt, prompt_opt, file) if x is not None]
    if len(given) > 1:
        fail("give the prompt once: PROMPT, -p/--prompt or -f/--file")
    if not given:
        fail("no prompt: give PROMPT, -p TEXT, -f FILE, or - to read standard input")
    if file is not None and str(file) != "-":
        try:
            text = file.read_bytes().decode("utf-8", "replace")
        except OSError as e:
            fail(f"-f/--file {file}: {e.strerror}")
    elif file is not None or prompt == "-" or prompt_opt == "-":
        text = sys.stdin.buffer.read().decode("utf-8", "replace")
    else:
        text = _clean(prompt if prompt is not None else prompt_opt)
    if not text:
        fail("empty prompt: give some text (PROMPT, -p, -f FILE or - for standard input)")
    return text


def _describe(session, setup) -> str:
    """The header: models, γ, placement, ablations — one line."""
    parts = [session.target.path.name]
    if session.draft is not None:
        name = session.draft_kind.value if session.cfg.draft.is_target else session.draft.path.name  # pool, mtp
        parts.append(f"draft {name}, γ={session.gamma}")
    else:
        parts.append("autoregressive")
    if session.gamma_note:
        parts.append(session.gamma_note)
    parts += setup.notes
    if session.engine is not None:
        st = session.engine.stats()
        parts.append(f"{st['n_slots']} slots")
        if session.cfg.pin_mapping:
            parts.append(f"{st['bytes_pinned'] / 1e9:.1f} GB of the mapping pinned" if st["bytes_pinned"] else
                         "--pin-mapping: the pool's device cannot pin the mapped file (copies read pageable memory)")
    elif session.engine_note and not setup.pool_off_reason:
        parts.append(session.engine_note)
    if session.cfg.ablations.names():
        parts.append("ablations: " + ", ".join(session.cfg.ablations.names()))
    return "; ".join(parts)


def _run_info(session, setup, opts: RunOptions) -> dict:
    """What --json reports about the run's setup: γ, seed, pool (or why it is off)."""
    stats = session.engine.stats() if session.engine is not None else None
    off = setup.pool_off_reason or (session.engine_note if session.engine is None else "")
    ctx = session.ctx
    return {"gamma": session.gamma, "gamma_note": session.gamma_note or None,
            # a recurrent (hybrid) target: how deep a verify pass can roll back, and how often a
            # trim past that computed the kept tokens again
            "recurrent": {"rollback": ctx.rollback, "replays": ctx.n_replays} if ctx.recurrent else None,
            "seed": opts.seed, "seed_random": opts.seed_random,
            "pool_device": session.cfg.pool[0].name if session.engine is not None else None,
            "budget_bytes": session.cfg.pool[0].budget.nbytes, "budget_ratio": session.cfg.pool[0].budget.ratio,
            "n_slots": stats["n_slots"] if stats else 0, "pool_off_reason": off or None,
            "notes": setup.notes, "n_gpu_layers": session.cfg.n_gpu_layers, "n_threads": session.cfg.n_threads,
            "n_ubatch": session.cfg.n_batch,
            "host_tier": _tiers_info(session.cfg.host_tiers, session.host_tier.stats() if session.host_tier else None),
            "host_layout": session.target.layout.to_dict(), "host_layout_summary": session.target.layout_report(),
            "draft_host_layout_summary": session.draft.layout_report() if session.draft not in (None, session.target) else None}


def _tiers_info(tiers, live: dict | None = None) -> dict | None:
    """--json's host_tier: the budget and where the experts are read from; live: the tier's stats
    (hits, stalls, bytes read from the disk) once it ran."""
    if tiers is None:
        return None
    return {"budget": tiers.budget, "experts_on_disk": tiers.on_disk, "tier_bytes": tiers.tier,
            "non_expert_bytes": tiers.non_expert, "expert_bytes": tiers.experts, "one_expert_bytes": tiers.one_expert,
            "kv_bytes": tiers.context, **(live or {})}


def _write(text: str) -> None:
    """To stdout, flushed; a full disk or a closed pipe is one line and exit 2, not a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        _drop_stdout()
        fail(f"cannot write to standard output: {e.strerror or e}")


def _drop_stdout() -> None:
    """After a failed write: point stdout at /dev/null so the exit-time flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _nan_output(session) -> str:
    """Why the output is garbage, when the target's last logits hold NaN or Inf ("" if not)."""
    try:
        finite = bool(np.isfinite(session.ctx.logits()).all())
    except (AttributeError, ValueError):  # no decode yet
        return ""
    if finite:
        return ""
    why = "its weights are damaged (--check-tensors names the tensor)"
    device = getattr(session.cfg, "device", None)
    if device not in (None, "CPU"):  # a device kernel can fault too (an H100 run once did)
        why = f"damaged weights (--check-tensors names the tensor) or a fault on {device} (try --device CPU)"
    return f"{session.target.path.name} computes NaN/Inf: {why}"


def _no_limit(n_predict: int, flag: str = "-n/--n-predict") -> int:
    """llama.cpp: -1 = no limit (-2: until the context is full, the same here)."""
    if n_predict < -2:
        fail(f"{flag} must be >= -1 (-1: no limit), got {n_predict}")
    return n_predict if n_predict >= 0 else sys.maxsize


# ----------------------------------------------------------------------------- commands

@app.command()
@run_options()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="prompt text; - reads standard input", show_default=False)] = None,
    prompt_opt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="prompt text (as llama.cpp)")] = None,
    file: Annotated[Optional[Path], typer.Option("-f", "--file", help="read the prompt from a file; - = stdin")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate, -1 = no limit")] = 128,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object (text and metrics)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the placement and setup, load nothing")] = False,
    *, opts: RunOptions,
) -> None:
    """Generate a continuation of PROMPT. Ctrl-C stops it (stop: interrupted, exit code 130)."""
    text = _read_prompt(prompt, prompt_opt, file) if not dry_run else ""
    max_tokens = _no_limit(n_predict)
    if dry_run:
        setup = session_setup(opts)
        cfg = setup.config
        info = {"model": str(cfg.model), "draft": None if cfg.draft.none else str(cfg.draft), "gamma": 0 if cfg.draft.none else cfg.gamma,
                "n_gpu_layers": cfg.n_gpu_layers, "pool_device": cfg.pool[0].name if cfg.expert_engine is not False else None,
                "budget_bytes": cfg.pool[0].budget.nbytes, "budget_ratio": cfg.pool[0].budget.ratio,
                "pool_devices": [{"name": d.name, "budget_bytes": d.budget.nbytes, "budget_ratio": d.budget.ratio}
                                 for d in cfg.pool] if cfg.expert_engine is not False else [],
                "pool_off_reason": setup.pool_off_reason or None, "notes": setup.notes, "seed": opts.seed,
                "recurrent_state_bytes": setup.state_bytes, "host_tier": _tiers_info(cfg.host_tiers)}
        tiers = "".join(line + "\n" for line in cfg.host_tiers.lines()) if cfg.host_tiers is not None else ""
        _write(json.dumps(info) + "\n" if json_out else "; ".join(setup.notes) + "\n" + tiers)
        return
    try:
        session, setup = open_session(opts, err, plain_progress=json_out)
    except KeyboardInterrupt:
        err.print("[dim]stop: interrupted (while loading)[/]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    interrupted = False
    try:
        if not json_out:
            err.print(Text(_describe(session, setup), style="dim"), soft_wrap=True)
        try:
            # Ctrl-C ends the generation before its next step, the caches kept valid
            with sigint_noted() as stop_requested:
                for chunk in session.generate(text, max_tokens, opts.stop, opts.sampling(), stop_requested):
                    if not json_out:
                        _write(chunk)
            interrupted = stop_requested()
        except (ModelError, ValueError, FloatingPointError) as e:
            fail(_nan_output(session) or str(e))
        if _nan_output(session):
            fail(_nan_output(session))
        m = session.last_metrics
        if interrupted:
            m.stop_reason = "interrupted"
        if json_out:
            # tokens: the generated ids, as llama-server's /completion returns them (`return_tokens`);
            # random weights decode to text that hides what was generated
            out = {"text": session.last_text, "tokens": session.last_tokens, "model": str(session.target.path),
                   "draft": (None if session.draft is None else session.draft_kind.value if session.cfg.draft.is_target
                             else str(session.draft.path)),
                   "engine": session.engine is not None, **_run_info(session, setup, opts), **m.to_dict()}
            _write(json.dumps(out) + "\n")
        else:
            _write("\n")
            err.print(Text(m.summary(), style="dim"), soft_wrap=True)
            if session.host_tier is not None:
                t = session.host_tier.stats()
                err.print(Text(f"experts on the disk: {t['hits']} hits, {t['stalls']} stalls, "
                               f"{t['bytes_read'] / 2**20:.0f} MiB read", style="dim"), soft_wrap=True)
    finally:
        session.close()
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
@run_options()
def chat(
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="max tokens per answer, -1 = no limit")] = 256,
    system: Annotated[Optional[str], typer.Option("--system", help="system message")] = None,
    *, opts: RunOptions,
) -> None:
    """Interactive chat, streamed. Ctrl-C stops an answer; Ctrl-C at the prompt (or Ctrl-D) exits.

    /reset forgets the conversation, /exit leaves."""
    max_tokens = _no_limit(n_predict)
    try:
        session, setup = open_session(opts, err)
    except KeyboardInterrupt:
        err.print("[dim]stop: interrupted (while loading)[/]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    console = Console(highlight=False)
    first = [{"role": "system", "content": _clean(system)}] if system else []
    messages = list(first)
    last_interrupt = 0.0
    try:
        console.print(Text(_describe(session, setup), style="dim"))
        if session.chat_template is None:
            console.print("[dim]no chat template in the model: the conversation is one running text[/]")
        console.print("[dim]Ctrl-C stops an answer, Ctrl-C at the prompt or Ctrl-D exits, /reset, /exit[/]")
        while True:
            try:
                line = _clean(console.input("[bold green]> [/]"))
            except EOFError:
                console.print()
                break
            except KeyboardInterrupt:
                if time.monotonic() - last_interrupt < _DOUBLE_CTRL_C_S:
                    console.print()  # the second press of a quick double Ctrl-C that stopped an answer
                    continue
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
            answer, ok, stopped = _answer(console, session, messages, max_tokens, opts.stop, opts.sampling())
            if not console.is_terminal:  # a terminal's Live leaves the cursor on a new line
                console.print()
            if stopped:
                last_interrupt = time.monotonic()
            if ok:
                messages.append({"role": "assistant", "content": answer})
            else:
                messages.pop()  # a failed turn is not part of the conversation
    finally:
        try:
            with deferred_sigint():  # leaving anyway: a Ctrl-C now changes nothing
                session.close()
                console.print("[dim]bye[/]")
        except KeyboardInterrupt:
            pass


_DOUBLE_CTRL_C_S = 1.0  # a Ctrl-C at the prompt this soon after one that stopped an answer is its double


def _answer(console: Console, session, messages, max_tokens, stop, sampling) -> tuple[str, bool, bool]:
    """Stream one answer under a live status line; Ctrl-C ends it early.
    Returns (text, whether it belongs in the conversation, whether Ctrl-C stopped it).

    Finished lines are printed above the live area, which holds only the line being written
    and the status: a long answer never outgrows the terminal (rich would freeze it)."""
    pending = ""  # the unfinished last line
    width = max(console.width, 20)

    def view(status: str) -> Group:
        return Group(Text(pending), Text(status, style="dim"))

    def status_line() -> str:
        s = session.recorder.live()
        parts = [f"{s['n_tokens']} tok", f"{s['tokens_per_s']:.1f} tok/s"]
        if s["acceptance_rate"] is not None:
            parts.append(f"accept {s['acceptance_rate']:.2f}")
        if s["device_share"] is not None:
            parts.append(f"device {s['device_share']:.0%}")
        return " | ".join(parts)

    def context_hint(e: Exception) -> str:
        return f"{e}: /reset starts a new conversation" if "context" in str(e) else str(e)

    try:
        tokens = session.chat_tokens(messages)
    except (ModelError, ValueError) as e:
        console.print(Text(context_hint(e), style="red"))
        return "", False, False
    if len(tokens) >= session.n_ctx:
        console.print(Text(f"the conversation ({len(tokens)} tokens) fills the context ({session.n_ctx}): "
                           "/reset starts a new conversation", style="red"))
        return "", False, False
    text = ""
    # Ctrl-C ends the answer before its next step; a quick second one is noted too, not raised
    with sigint_noted() as stop_requested, \
            Live(view("..."), console=console, refresh_per_second=8, transient=False) as live:
        try:
            for chunk in session.generate(tokens, max_tokens, stop, sampling, stop_requested):
                text += chunk
                pending += chunk
                *done, pending = pending.split("\n")
                while len(pending) >= width:  # a line wider than the terminal: print its full rows
                    done.append(pending[:width])
                    pending = pending[width:]
                for row in done:
                    live.console.print(Text(row), soft_wrap=True)
                live.update(view(status_line()))
        except ModelError as e:
            live.update(view(f"error: {context_hint(e)}"))
            return text, False, False
        if stop_requested():
            live.update(view(status_line() + " | interrupted"))
            return text, True, True
        m = session.last_metrics
        summary = m.summary()
        if m.stop_reason == "context":
            summary += " | the context is full: /reset starts a new conversation"
        live.update(view(summary))
    return text, True, False


@app.command()
@run_options("model")
def calibrate(*, opts: RunOptions) -> None:
    """Measure the unit costs of the workload balancer again and print them as JSON."""
    opts = opts.replace(recalibrate=True, expert_engine=True, ablations=())
    try:
        session, _ = open_session(opts, err)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    try:
        _write(json.dumps(asdict(session.calibration), indent=1) + "\n")
    finally:
        session.close()


@app.command()
@run_options()
def serve(
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port to listen on")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SPAC_API_KEY", show_default=False,
                                                   help="clients must send `Authorization: Bearer KEY`")] = None,
    queue_size: Annotated[int, typer.Option("--queue", help="requests that may wait behind the running one")] = 16,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="max tokens of a request that sets none, "
                                                                    "-1 = until the context is full")] = -1,
    *, opts: RunOptions,
) -> None:
    """OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /health, /metrics, ...

    The sampling options are the defaults of requests that leave them out (--seed -1: a new seed
    per request). SIGINT/SIGTERM stop it cleanly (exit 0)."""
    # imported here: the server's web stack (starlette, uvicorn, pydantic) costs every other command
    # ~0.2 s of start-up
    from orchestrator.server import Defaults
    from orchestrator.server import serve as run_server

    if queue_size < 0:
        fail(f"--queue must be >= 0, got {queue_size}")
    cfg = session_setup(opts).config
    sampling = opts.sampling()
    defaults = Defaults(sampling=replace(sampling, seed=None) if opts.seed_random else sampling, stop=list(opts.stop),
                        max_tokens=n_predict if n_predict >= 0 else None)
    with progress.reporting(progress.PlainReporter()):  # the session loads while uvicorn logs: lines, not a display
        error = run_server(lambda: Session(cfg), Path(cfg.model).name, host=host, port=port, api_key=api_key,
                           defaults=defaults, queue_size=queue_size)
    if error:
        fail(error)



@app.command("rpc-server")
def rpc_server(
    host: Annotated[str, typer.Option("-H", "--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("-p", "--port", help="port to listen on")] = 50052,
    threads: Annotated[int, typer.Option("-t", "--threads", help="CPU threads of the served CPU device")] = 0,
    device: Annotated[Optional[str], typer.Option("-d", "--device", show_default=False,
                                                  help="ggml device to serve \\[default: the first GPU, else the CPU]")] = None,
    exact: Annotated[bool, typer.Option("--exact/--no-exact", help="a served CPU device computes batches of up to "
                                        "32 tokens row by row as one token, as the client's host does (spac generate's "
                                        "--exact)")] = True,
) -> None:
    """Serve this machine's GPU (or CPU) to spac or llama.cpp on another machine (`--rpc HOST:PORT`
    there), as llama.cpp's rpc-server. Unauthenticated: never on an untrusted network."""
    if not 0 < port < 65536:
        fail(f"-p/--port must be 1..65535, got {port}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]WARNING: serving on {host}: {rpc.WARNING}[/]", soft_wrap=True)
    set_batch_invariant_rows(EXACT_ROWS if exact else 0)
    try:
        rpc.serve(f"{host}:{port}", threads if threads > 0 else default_threads(), device,
                  on_ready=lambda: err.print(f"RPC server on {host}:{port} ({device or 'first GPU, else CPU'}); "
                                             "Ctrl-C stops it"))
    except NativeError as e:
        fail(f"-d/--device or -H/-p: {e}")
    except KeyboardInterrupt:
        err.print("[dim]stop: interrupted[/]")
        raise typer.Exit(EXIT_INTERRUPTED) from None

# the command groups of other modules: the simulator's (a leaf: it never imports the session,
# so the live `trace record` is added to its `trace` group here) and the draft tools
sim_cli.trace_app.command("record")(record.record_cmd)
sim_cli.profile_app.command("measure")(profile_measure.measure_cmd)
app.add_typer(sim_cli.app, name="sim")
app.add_typer(sim_cli.trace_app, name="trace")
app.add_typer(drafts.app, name="draft")

def main() -> None:
    """The `spac` entry point."""
    app()


if __name__ == "__main__":
    main()
