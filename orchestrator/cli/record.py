"""`spac trace record`: the routing of a live run written as a trace the simulator replays.

The live side of traces: it opens a session (the expert engine exports the routing of every
verify pass, and the MoE draft's routing while it drafts) and writes `orchestrator.sim.trace`
files. The main CLI mounts `record_cmd` into the simulator's `spac trace` group, so `sim/`
never imports the session.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer

from orchestrator.cli.options import RunOptions, run_options
from orchestrator.cli.setup import open_session
from orchestrator.decoding.sampling import SamplingParams
from orchestrator.runtime.placement import first_gpu
from orchestrator.policies.plan import StepRouting
from orchestrator.sim.cli import console, err_console, working
from orchestrator.sim.trace import Trace, TraceWriter, read_trace


def record_trace(session, out: Path, prompts, max_tokens: int, meta: dict | None = None) -> Trace:
    """Generate greedily from each prompt on an open `orchestrator.decoding.speculative.Session` (expert
    engine on: it exports the routing) and write every verification step to `out`."""
    engine = session.engine
    if engine is None:
        raise ValueError("recording needs the expert engine (routing export): " + (session.engine_note or "engine off"))
    writer = TraceWriter(out, n_layer=engine.n_moe_layers, n_expert=engine.n_expert, top_k=engine.n_expert_used,
                         model=Path(str(session.target.path)).stem,
                         meta={"gamma": session.gamma, "mode": session.mode, "prompts": len(prompts),
                               "gguf": str(Path(str(session.target.path)).resolve()),
                               "draft_gguf": None if session.draft is None else str(Path(str(session.draft.path)).resolve()),
                               "max_tokens": max_tokens, **(meta or {})})
    def append(step: StepRouting) -> None:  # with the draft's routing when the draft is an MoE
        writer.append(step, session.last_draft_routing)

    previous = session.on_step, session.on_prompt
    session.on_step, session.on_prompt = append, writer.append_prompt
    try:
        for prompt in prompts:
            session.complete(prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
    finally:
        session.on_step, session.on_prompt = previous
        writer.close()
    return read_trace(out)


@run_options("model")
def record_cmd(out: Path = typer.Argument(..., help="trace file to write (.npz)"),
               prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="prompt text (repeatable)"),
               prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="one prompt per line"),
               n_predict: int = typer.Option(128, "-n", "--n-predict", help="tokens per prompt"),
               *, opts: RunOptions) -> None:
    """Record the routing of a live run (greedy, expert engine on): per verification step the
    draft length, accepted count and the experts and weights of every verified token. The model
    flags are generate's; without a GPU the pool (which exports the routing) is the CPU test device."""
    texts = list(prompt or [])
    if prompts_file is not None:
        texts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not texts:
        raise typer.BadParameter("give --prompt or --prompts-file", param_hint="--prompt")
    if opts.pool[0].name is None and first_gpu() is None:  # no --device and no GPU: the CPU test device
        opts = replace(opts, pool=(replace(opts.pool[0], name="CPU"),))
    session, _ = open_session(opts.replace(expert_engine=True), err_console)
    try:
        with working(f"recording {len(texts)} prompt(s) x {n_predict} tokens"), session:
            t = record_trace(session, out, texts, n_predict)
    except (ValueError, OSError, RuntimeError) as e:
        console.print(f"[red]spac trace record: {e}[/red]")
        raise typer.Exit(code=2) from None
    console.print(f"wrote {out}: {t.n_steps} steps, {t.n_generated} tokens, {t.n_layer} MoE layers, "
                  f"{t.n_expert} experts, top-{t.top_k}")
