"""From checked options to a session: the default models, the placement and the session itself.

    setup = session_setup(opts)            # loads nothing: `spac generate --dry-run` prints setup.notes
    session, setup = open_session(opts, err)  # its loading shown on stderr; or one line there and exit 2

`resolve_models` picks the target and the draft (-m/-md, the shipped models, else the pool
draft); `session_setup` checks the files, lists the devices (registering --rpc servers first),
places the weights (runtime/placement.py) and returns the SessionConfig with a note per decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from orchestrator import shipped_models
from orchestrator.cli.options import RunOptions, fail
from orchestrator.decoding.mtp_draft import MTP_DRAFT
from orchestrator.decoding.speculative import POOL_DRAFT, Session, SessionConfig
from orchestrator.runtime import progress
from orchestrator.runtime.llm import ModelError, check_gguf
from orchestrator.runtime.native import NativeError, engine_built
from orchestrator.runtime.placement import (GPU, PlacementError, devices, first_gpu, model_sizes, place, place_several,
                                           recurrent_states)
from orchestrator.runtime.pool import DEFAULT_BUDGET_RATIO, Budget, PoolDevice, StreamPrefill
from orchestrator.runtime.rpc import register_servers


def default_models(models_dir: Path | None = None) -> tuple[Path | None, Path | None]:
    """(target, default draft) of the shipped models (`orchestrator.shipped_models`), or (None, None)
    when there is no manifest; the draft is None if the manifest names none."""
    models_dir = models_dir or shipped_models.MODELS_DIR
    try:
        target = shipped_models.default_model("target", models_dir)
    except (OSError, KeyError, ValueError):
        return None, None
    try:
        draft = shipped_models.default_model("draft", models_dir)
    except (KeyError, ValueError):
        draft = None
    return target, draft


def _is_shipped_target(path: Path, target: Path) -> bool:
    """The shipped target, by path or (same size first, then sha256) by content: a copy
    elsewhere still finds its draft."""
    try:
        if path.resolve() == target.resolve():
            return True
        entry = next(f for f in shipped_models.manifest(target.parent)["files"] if f["role"] == "target")
        return path.stat().st_size == entry["bytes"] and shipped_models.sha256_file(path) == entry["sha256"]
    except (OSError, KeyError, StopIteration, ValueError):
        return False


def resolve_models(opts: RunOptions) -> tuple[Path, Path | None, str]:
    """(target, draft, note): -m/-md, else the shipped models, else the pool draft (POOL_DRAFT,
    dropped by session_setup when the pool is off); note says why there is no draft."""
    model, draft = opts.model, opts.model_draft
    shipped_target, shipped_draft = default_models()
    note = ""
    if opts.draft in ("pool", "mtp"):
        draft = POOL_DRAFT if opts.draft == "pool" else MTP_DRAFT
    if model is None:
        if shipped_target is None:
            fail("no model given (-m) and no shipped default models (orchestrator/shipped_models/MANIFEST.json is missing)")
        model = shipped_target
        draft = draft or shipped_draft
    elif draft is None:
        if shipped_target is not None and _is_shipped_target(model, shipped_target):
            draft = shipped_draft
        else:
            draft = POOL_DRAFT  # the target drafts through its pool, if it gets one (session_setup)
    if opts.draft == "none":
        draft, note = None, "no draft (--draft none)"
    if opts.draft_max == 0 and draft is not None:
        draft, note = None, "no draft (--spec-draft-n-max 0)"
    if "no_sd" in opts.ablations and draft is not None:
        draft, note = None, "no draft (--no-sd)"
    return model, draft, note


@dataclass
class Setup:
    """What `open_session` decided before loading anything."""

    config: SessionConfig
    notes: list[str]           # one line each, for the header and --json: no draft, pool placement
    pool_off_reason: str = ""  # empty when the pool is (to be) on
    state_bytes: int = 0       # a hybrid model's recurrent states, every layer (placement.recurrent_states)


def session_setup(opts: RunOptions) -> Setup:
    """SessionConfig and placement from the options; a bad file, device or budget is `fail`."""
    model, draft, draft_note = resolve_models(opts)
    for path in (model, draft):
        if path is not None and path not in (POOL_DRAFT, MTP_DRAFT):
            try:
                check_gguf(path)
            except ModelError as e:
                fail(str(e))
    try:
        sizes = model_sizes(model)
    except Exception as e:  # noqa: BLE001 - the gguf reader raises many kinds on a damaged file
        fail(f"{model}: cannot read the GGUF header ({type(e).__name__}: {e})")
    n_ctx = opts.ctx_size or sizes.n_ctx_train or 4096
    engine = opts.expert_engine
    if engine is None and any(d.name is not None or not d.budget.auto for d in opts.pool):
        engine = True  # asked for a pool: failing to make one is an error, not a silent fallback
    built = engine_built()
    if engine and not built:
        fail("--engine/--device/--expert-budget: this llama.cpp has no spac engine (run scripts/build_native.py)")
    if opts.rpc:  # before anything lists devices: the servers' devices join ggml's list
        try:
            register_servers(opts.rpc)
        except NativeError as e:
            fail(f"--rpc: {e}")
    names = [d.name for d in opts.pool if d.name is not None]
    budgets = [d.budget for d in opts.pool]
    seen: dict[str, GPU] = {}
    if names != ["CPU"]:
        listed = devices()
        seen = {name: GPU(name, free, total) for name, _, free, total in listed}
        for name in names:
            if name not in seen:
                fail(f"--device {name}: no such device; ggml sees {', '.join(seen)} (CPU = the test stand-in)")
        if not names and engine is not False and sizes.expert_bytes:
            # as llama.cpp: every GPU it sees takes layers (an RPC server's device counts as one)
            names = [name for name, kind, _, _ in listed if kind == 1]
            budgets = budgets * max(len(names), 1)  # --expert-budget without --device: one value for every GPU

    stream = opts.stream_prefill is not StreamPrefill.OFF

    def plan(states: int):
        try:
            if len(names) > 1:
                if not sizes.expert_bytes or engine is False:
                    fail("--device with several devices: the expert pool is off (--no-engine or a dense model); "
                         "give one device")
                return place_several(sizes, n_ctx, [seen[n] for n in names], budgets, opts.n_gpu_layers,
                                     stream=stream, states=states)
            return place(sizes, n_ctx, first_gpu(), opts.pool[0].name, budgets[0], opts.n_gpu_layers,
                         engine if sizes.expert_bytes else False, stream=stream, states=states,
                         auto_ubatch=not opts.ubatch_size)
        except PlacementError as e:
            fail(str(e))

    def pool_off(p) -> str:
        if not sizes.expert_bytes:
            return f"expert pool off: {model.name} is dense (no routed experts)"
        if engine is False:
            return "expert pool off (--no-engine)"
        if not built:
            return "expert pool off: this llama.cpp has no spac engine (scripts/build_native.py)"
        return p.note if not p.pool else ""

    # a hybrid's recurrent states: γ snapshots in the target's context when it speculates, two in a pool draft's
    p = plan(recurrent_states(opts.draft_max if draft is not None else 0, draft == POOL_DRAFT))
    off = pool_off(p)
    if draft == POOL_DRAFT and off and sizes.state_bytes:  # no pool, no pool draft: the target's one state
        p = plan(recurrent_states(0, False))
        off = pool_off(p)
    if not p.stream_prefill and opts.stream_prefill in (StreamPrefill.AHEAD, StreamPrefill.USED):  # asked for: an error
        fail(f"--stream-prefill {opts.stream_prefill.value}: {p.stream_off} (a smaller --expert-budget makes room)")
    notes = [n for n in (draft_note,) if n]
    notes.append(off or p.note)
    if draft == POOL_DRAFT and off:
        if opts.draft == "pool":
            fail(f"--draft pool needs the expert pool, which is off: {off}")
        draft = None
        notes.insert(0, "no draft (-md DRAFT.gguf, or an expert pool for the pool draft)")
    elif draft == POOL_DRAFT:
        notes.insert(0, "draft: the target through its expert pool (--draft none: no speculation)")
    cfg = SessionConfig(model=model, draft=draft, gamma=opts.draft_max, n_ctx=opts.ctx_size, n_batch=opts.ubatch_size or p.ubatch,
                        n_threads=opts.threads,
                        repack=opts.repack, n_gpu_layers=p.n_gpu_layers, expert_engine=False if off else engine,
                        pool=p.pool or (PoolDevice("CPU", Budget(ratio=DEFAULT_BUDGET_RATIO)),),
                        stream_prefill=opts.stream_prefill if p.stream_prefill else StreamPrefill.OFF,
                        tensor_split=p.tensor_split,
                        ablations=opts.ablation_switches(),
                        recalibrate=opts.recalibrate, verbose=opts.verbose, check_tensors=opts.check_tensors,
                        mmap=opts.mmap, pin_mapping=opts.pin_mapping, exact=opts.exact)
    return Setup(cfg, notes, off, p.state_bytes)


def open_session(opts: RunOptions, err: Console | None = None, plain_progress: bool = False):
    """(Session, Setup), or one clear line and exit 2 (bad file, vocabulary mismatch, engine).
    Ctrl-C while loading raises KeyboardInterrupt (never lost in a native callback). The loading's
    phases are shown on stderr (runtime/progress.py): live on `err` when it is a terminal, else, or
    with plain_progress (--json), as plain lines."""
    setup = session_setup(opts)
    try:
        # the display ends before an error line is printed
        with progress.reporting(progress.on_stderr(err or Console(stderr=True), plain=plain_progress)):
            session = Session(setup.config)
    except (ModelError, NativeError, ValueError) as e:
        fail(str(e))
    return session, setup
