"""From checked options to a session: the default models, the placement and the session itself.

    setup = session_setup(opts)            # loads nothing: `spac generate --dry-run` prints setup.notes
    session, setup = open_session(opts, err)  # its loading shown on stderr; or one line there and exit 2

`session_setup` reads top to bottom: options (`resolve_models`: -m/-md/--draft, the shipped
models, else the pool draft, as a `Draft`; the files checked; the MTP head instead where the
file has one) → devices (`_pool_devices`:
--engine, --rpc servers registered first, --device against ggml's list) → placement (`_place`,
runtime/placement.py; `_place_without_pool_draft` when a hybrid's pool draft lost its pool) →
the session's config (`RunOptions.config` with what was resolved), with a note per decision.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from orchestrator import shipped_models
from orchestrator.cli.options import RunOptions, fail
from orchestrator.decoding.draft import MTP_DRAFT, NO_DRAFT, POOL_DRAFT, Draft, DraftKind
from orchestrator.decoding.speculative import Session, SessionConfig
from orchestrator.runtime import progress
from orchestrator.runtime.host_tier import HostBudget, HostTiers, plan_tiers
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


def resolve_models(opts: RunOptions) -> tuple[Path, Draft, str]:
    """(target, draft, note): -m/-md, else the shipped models, else the pool draft (POOL_DRAFT:
    session_setup makes it the MTP head where the file has one, and drops it when the pool is
    off); note says why there is no draft."""
    model = opts.model
    draft = Draft.of(opts.model_draft) if opts.draft is None else Draft.of(opts.draft)
    shipped_target, shipped_draft = default_models()
    note = ""
    if model is None:
        if shipped_target is None:
            fail("no model given (-m) and no shipped default models (orchestrator/shipped_models/MANIFEST.json is missing)")
        model = shipped_target
        if draft.none and opts.draft is None:
            draft = Draft.of(shipped_draft)
    elif draft.none and opts.draft is None:
        if shipped_target is not None and _is_shipped_target(model, shipped_target):
            draft = Draft.of(shipped_draft)
        else:
            draft = POOL_DRAFT  # the target drafts through its pool, if it gets one (session_setup)
    if opts.draft is DraftKind.NONE:
        draft, note = NO_DRAFT, "no draft (--draft none)"
    if opts.config.gamma == 0 and not draft.none:
        draft, note = NO_DRAFT, "no draft (--spec-draft-n-max 0)"
    if "no_sd" in opts.ablations and not draft.none:
        draft, note = NO_DRAFT, "no draft (--no-sd)"
    return model, draft, note


@dataclass
class Setup:
    """What `open_session` decided before loading anything."""

    config: SessionConfig
    notes: list[str]           # one line each, for the header and --json: no draft, pool placement
    pool_off_reason: str = ""  # empty when the pool is (to be) on
    state_bytes: int = 0       # a hybrid model's recurrent states, every layer (placement.recurrent_states)


@dataclass
class _Devices:
    """The pool's devices as session_setup found them: names (none: no pool device), budgets, what ggml sees."""

    names: list[str]
    budgets: list[Budget]
    seen: dict[str, GPU]
    expert_engine: bool | None  # True: asked for (a failure is an error), None: when possible, False: off


def session_setup(opts: RunOptions) -> Setup:
    """SessionConfig and placement from the options; a bad file, device or budget is `fail`.
    Options → devices → placement → the session's config, top to bottom."""
    model, draft, draft_note = resolve_models(opts)
    sizes = _check_files(model, draft)
    if draft.kind is DraftKind.POOL and opts.draft is None and sizes.mtp_layers:
        # the file's MTP head drafts, as vLLM's MTP method does for these models: one block and the
        # head per token, where the pool draft reads every block (bench/sim_gpu_projection.py)
        draft = MTP_DRAFT
    dev = _pool_devices(opts, sizes)
    p = _place(opts, sizes, dev, draft)
    off = _pool_off(model, sizes, dev.expert_engine, p)
    if draft.kind is DraftKind.POOL and off and sizes.state_bytes:
        p, off = _place_without_pool_draft(opts, sizes, dev, model)
    if not p.stream_prefill and opts.config.stream_prefill in (StreamPrefill.AHEAD, StreamPrefill.USED):  # asked for
        fail(f"--stream-prefill {opts.config.stream_prefill.value}: {p.stream_off} (a smaller --expert-budget makes room)")
    notes = [n for n in (draft_note,) if n] + [off or p.note]
    if draft.kind is DraftKind.POOL and off:
        if opts.draft is DraftKind.POOL:
            fail(f"--draft pool needs the expert pool, which is off: {off}")
        draft = NO_DRAFT
        notes.insert(0, "no draft (-md DRAFT.gguf, or an expert pool for the pool draft)")
    elif draft.kind is DraftKind.POOL:
        notes.insert(0, "draft: the target through its expert pool (--draft none: no speculation)")
    elif draft.kind is DraftKind.MTP and opts.draft is None:
        notes.insert(0, "draft: the target's MTP head (--draft pool: the pool draft; --draft none: no speculation)")
    pool = p.pool or (PoolDevice("CPU", Budget(ratio=DEFAULT_BUDGET_RATIO)),)
    tiers = _host_tiers(opts, sizes, pool if not off else (), p.n_gpu_layers, draft.kind is DraftKind.POOL and not off)
    if tiers.on_disk:
        notes.append(f"experts on the disk: {tiers.n_kept} of {tiers.n_experts} kept in memory (--host-budget)")
    stream = opts.config.stream_prefill if p.stream_prefill else StreamPrefill.OFF
    cfg = replace(opts.config, model=model, draft=draft, n_batch=opts.ubatch_size or p.ubatch, n_threads=opts.threads,
                  n_gpu_layers=p.n_gpu_layers, expert_engine=False if off else dev.expert_engine, pool=pool,
                  stream_prefill=stream.resolve(pool[0]), tensor_split=p.tensor_split,
                  ablations=opts.ablation_switches(), host_tiers=tiers)
    return Setup(cfg, notes, off, p.state_bytes)


def _host_tiers(opts: RunOptions, sizes, pool: tuple[PoolDevice, ...], n_gpu_layers: int, pool_draft: bool) -> HostTiers:
    """--host-budget against the model's sizes: where its experts are read from. A file larger than
    the budget keeps its experts on the disk; what cannot work then is one line and exit 2."""
    cfg = opts.config
    pool_bytes = [(d.on_host, d.budget.nbytes or int(d.budget.ratio * sizes.expert_bytes)) for d in pool]
    on_host = sum(n for host, n in pool_bytes if host)
    on_device = sum(n for host, n in pool_bytes if not host)
    # the KV caches of the layers left on the host: the target's, and a pool draft's of the same shape
    host_layers = 1.0 if n_gpu_layers == 0 else max(sizes.n_layer - max(n_gpu_layers, 0), 0) / max(sizes.n_layer, 1)
    n_ctx = cfg.n_ctx or sizes.n_ctx_train or 4096
    kv = int(sizes.kv_bytes_per_token * n_ctx * host_layers * (2 if pool_draft else 1))
    try:
        tiers = plan_tiers(HostBudget.parse(cfg.host_budget), sizes.non_expert_bytes, sizes.expert_bytes,
                           sizes.one_expert, pool_host=on_host, pool_device=on_device, context=kv)
    except ValueError as e:  # --mlock would lock what does not fit
        fail(f"{'--mlock with ' if cfg.mlock else ''}--host-budget: {e}")
    if tiers.on_disk:
        total = (sizes.non_expert_bytes + sizes.expert_bytes) / 2**30
        over = f"over the host budget of {tiers.budget / 2**30:.2f} GiB (--host-budget)"
        if not cfg.mmap:
            fail(f"--no-mmap reads all {total:.2f} GiB of weights into memory, {over}: without it the experts "
                 "that do not fit stay on the disk")
        if cfg.pin_mapping:
            fail(f"--pin-mapping pins all {sizes.expert_bytes / 2**30:.2f} GiB of experts, {over}")
    return tiers


def _check_files(model: Path, draft: Draft):
    """The GGUF files readable, and the target's sizes from its header (placement.model_sizes)."""
    for path in (model, draft.path):
        if path is not None:
            try:
                check_gguf(path)
            except ModelError as e:
                fail(str(e))
    try:
        return model_sizes(model)
    except Exception as e:  # noqa: BLE001 - the gguf reader raises many kinds on a damaged file
        fail(f"{model}: cannot read the GGUF header ({type(e).__name__}: {e})")


def _pool_devices(opts: RunOptions, sizes) -> _Devices:
    """--engine, --rpc, --device and --expert-budget against what ggml sees: the pool's devices."""
    engine = opts.config.expert_engine
    if engine is None and any(d.name is not None or not d.budget.auto for d in opts.pool):
        engine = True  # asked for a pool: failing to make one is an error, not a silent fallback
    if engine and not engine_built():
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
    return _Devices(names, budgets, seen, engine)


def _place(opts: RunOptions, sizes, dev: _Devices, draft: Draft, states: int | None = None):
    """The placement (runtime/placement.py) on the pool's devices. A hybrid's recurrent states:
    γ snapshots in the target's context when it speculates, two in a pool draft's."""
    if states is None:
        states = recurrent_states(opts.config.gamma if not draft.none else 0, draft.kind is DraftKind.POOL)
    stream = opts.config.stream_prefill is not StreamPrefill.OFF
    try:
        if len(dev.names) > 1:
            if not sizes.expert_bytes or dev.expert_engine is False:
                fail("--device with several devices: the expert pool is off (--no-engine or a dense model); "
                     "give one device")
            return place_several(sizes, opts.config.n_ctx or sizes.n_ctx_train or 4096, [dev.seen[n] for n in dev.names],
                                 dev.budgets, opts.n_gpu_layers, stream=stream, states=states)
        return place(sizes, opts.config.n_ctx or sizes.n_ctx_train or 4096, first_gpu(), opts.pool[0].name,
                     dev.budgets[0], opts.n_gpu_layers, dev.expert_engine if sizes.expert_bytes else False,
                     stream=stream, states=states, auto_ubatch=not opts.ubatch_size)
    except PlacementError as e:
        fail(str(e))


def _pool_off(model: Path, sizes, engine: bool | None, p) -> str:
    """Why the expert pool is off ("" when it is on)."""
    if not sizes.expert_bytes:
        return f"expert pool off: {model.name} is dense (no routed experts)"
    if engine is False:
        return "expert pool off (--no-engine)"
    if not engine_built():
        return "expert pool off: this llama.cpp has no spac engine (scripts/build_native.py)"
    return p.note if not p.pool else ""


def _place_without_pool_draft(opts: RunOptions, sizes, dev: _Devices, model: Path):
    """Placed again for a hybrid whose pool draft was planned but whose pool is off: without the
    pool draft's two recurrent states, only the target's one (no pool, no pool draft)."""
    p = _place(opts, sizes, dev, NO_DRAFT, states=recurrent_states(0, False))
    return p, _pool_off(model, sizes, dev.expert_engine, p)


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
