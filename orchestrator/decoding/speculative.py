"""The speculative loop: draft γ tokens, verify γ+1 in one target pass, accept, trim, plan.

One verification step (MoE-SpAc §2–3):

    draft    γ single-token decodes of the draft context (the first one also catches the draft
             up on the tokens it has not seen yet), each sampled from the draft's distribution q
    verify   one target decode of [last, d1..dγ] with logits for every position
    accept   greedy: the longest prefix where the target's argmax equals the draft, then the
             target's own token; sampling: Leviathan et al. rejection sampling (accept d_i with
             probability min(1, p/q), else sample max(0, p − q)), so the output follows the
             target's distribution exactly; temperature, top-k and top-p shape p and q alike
    trim     both KV caches drop the rejected positions (llama_memory_seq_rm)
    plan     with an engine: the routing of the verify pass (all γ+1 positions: each of them was
             routed and computed) → a `Policy` (default: MoE-SpAc, `orchestrator.policies.spac`:
             utility estimator and workload balancer) → `ExpertEngine.set_plan`, before the
             next drafting starts so that the copy engine prefetches while the draft drafts

Invariant between steps: `tokens` is the whole sequence (prompt and output), the target's KV
cache holds tokens[:-1] (the last token is the first one of the next verify batch), the draft's
KV cache holds a prefix of tokens. A new request reuses the longest common prefix of the cached
sequence (chat turns re-render the whole conversation and pay only for the new part).

Greedy decoding is token-identical to target-only greedy decoding: the verify pass computes the
same logits a single-token decode would, and the accepted tokens are the target's argmax.

Why one module of ~690 lines: the session's state (token sequence, two KV caches or a
recurrent fork, plan in force, governor, draft routing) is shared by every step of the loop,
and opening it (target, draft of four kinds, engine over one or several devices, calibration)
decides what the loop may do (its config declares the session's own flags, orchestrator/option.py:
one declaration each); what drafts (draft.py), the maths (sampling.py), the text (text.py), the MTP draft
(mtp_draft.py), the policies and the engine bindings live elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Optional

import numpy as np

from orchestrator.decoding.draft import MTP_DRAFT, NO_DRAFT, POOL_DRAFT, Draft, DraftKind  # noqa: F401 - re-exported
from orchestrator.decoding.governor import Governor, GovernorConfig
from orchestrator.decoding.metrics import RunMetrics, RunRecorder
from orchestrator.decoding.mtp_draft import MtpDraft, require_mtp
from orchestrator.decoding.sampling import SamplingParams, distribution, sample, verify_greedy, verify_sampled
from orchestrator.decoding.text import ChatTemplate, TextStream, check_vocab
from orchestrator.option import at_least, one_of, option
from orchestrator.runtime import calibrate
from orchestrator.runtime.host_layout import Repack, set_batch_invariant_rows
from orchestrator.runtime.llm import Context, Model, ModelError
from orchestrator.runtime.host_tier import HostTier, HostTiers, check_host_budget
from orchestrator.runtime.native import (MISS_MAX_TOKENS, ExpertsOnDisk, ExpertEngine, MissCosts, NativeError, Routing,
                                        SeveralPools, copies_block_compute, model_layer_devices, model_moe_layers)
from orchestrator.runtime.placement import PlacementError, pool_layer_ranges
from orchestrator.runtime.pool import DEFAULT_BUDGET_RATIO, Budget, PoolDevice, StreamPrefill
from orchestrator.policies.base import Feedback, Policy, PolicyContext, observe
from orchestrator.policies.cache import ReuseCredited
from orchestrator.policies.default import LookaheadUtility
from orchestrator.policies.plan import Plan, StepRouting
from orchestrator.policies.spac import Ablations, MoESpAc


# ----------------------------------------------------------------------------- policy

class MissRule(str, Enum):
    """--miss-rule: where a pass computes a routed expert the pool lacks. HOST: on the host, the
    pool following the plan made after each step. REUSE: decided at each MoE layer once its router
    has run (patch 0031): uploaded, computed on the host or streamed once, by the measured costs and
    the expert's reuse (`policies.cache.ReuseCredited`); the pool is then a cache and gets no plans."""

    HOST = "host"
    REUSE = "reuse"


def spac_policy(ablations: Ablations, k_max: int = 4, lam: float = 0.1, miss_rule: MissRule = MissRule.HOST) -> Policy:
    """The default policy: spac's learned utility with the draft's lookahead (`policies.default`;
    misses on the host, as the engine computes them). With one of the paper's ablation switches:
    MoE-SpAc as written (estimator + balancer), with that switch. `MissRule.REUSE`: spac's miss
    rule instead, which takes no switch but --no-sd."""
    switches = sorted(set(ablations.names()) - {"no_sd"})
    if miss_rule is MissRule.REUSE:
        if switches:
            raise ValueError(f"--miss-rule reuse decides every miss in the pass and makes no plan: it takes no "
                             f"{', '.join('--' + s.replace('_', '-') for s in switches)}")
        return ReuseCredited()
    if not switches:
        return LookaheadUtility(miss="cpu")
    return MoESpAc(k_max=k_max, lam=lam, **ablations.policy_flags())


# ----------------------------------------------------------------------------- session

# the batches computed as one token is, as many as llama.cpp's expert cache counts as a verify pass
EXACT_ROWS = 32


@dataclass
class SessionConfig:
    """What a Session opens and how it decodes. A field declared with `option` is also a flag of
    `spac generate`/`chat`/`serve` (cli/options.py makes the typer parameter from it, the same
    name, type, default, help and check); the others are filled in by cli/setup.py's
    `session_setup` from the CLI-only flags (-m/-md/--draft, --device, --expert-budget, -ngl, -ub)."""

    model: str | Path
    # a Draft (orchestrator.decoding.draft); None, a path, "pool" or "mtp" are taken as Draft.of takes them
    draft: Draft | str | Path | None = NO_DRAFT
    # the draft length, or its upper bound with adaptive_gamma
    gamma: int = option("--spec-draft-n-max", "--draft-max", default=8, check=at_least(0, "0: no draft"),
                        help="most draft tokens per verification step; greedy: γ adapts below it every step (MoE-SpeQ's "
                        "governor), sampling: γ is this bound (the same seed gives the same text); 0 = no draft")
    gamma_min: int = option("--spec-draft-n-min", "--draft-min", default=0, check=at_least(0),
                            help="fewest draft tokens per verification step once drafting (llama.cpp's --draft-min); "
                            "0 lets the governor take a plain target step where drafting does not pay")
    adaptive_gamma: bool = True  # greedy: γ chosen every step by MoE-SpeQ's governor (orchestrator.decoding.governor)
    k_max: int = 4
    lam: float = 0.1
    n_ctx: int = option("-c", "--ctx-size", default=0, check=at_least(0, "0: the model's"),
                        help="context size, 0 = the model's")  # 0: the GGUF's context_length
    n_batch: int = 512
    n_threads: int = 2
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    repack: Repack = option("--repack", default=Repack.AUTO, cli_type=str, check=one_of(Repack), help=(
        "host weights' layout: auto (per tensor type, measured on this CPU: the repacked layout, "
        "spac's CPU_EXACT for Q4_0/Q8_0/IQ4_NL/IQ4_XS/MXFP4/Q2_K-Q6_K (F16/BF16 in place) and llama.cpp's for the rest, where it decodes faster, "
        "the file's plain layout for prompts where that is faster; a GPU run's experts: CPU_EXACT with plain twins "
        "for its prompts, or plain), on (each weight in the first layout that takes it, as llama.cpp's --repack 1: CPU_EXACT "
        "first; with a GPU as llama.cpp's --no-host, so a prompt's host experts run on the CPU), off (the file's layout); "
        "with --no-exact, llama.cpp's layouts only (no CPU_EXACT)"))
    expert_engine: bool | None = option(
        "--engine/--no-engine", default=None, cli_type=Optional[bool], show_default=False,
        help="expert pool on/off \\[default: on when built and a pool device exists]")  # the ExpertEngine
    # the pool's devices with their budgets: "CPU" (the test device, a second host buffer) or ggml
    # names; several: llama.cpp's layer split puts a range of layers on each, and each pool holds
    # its own layers' experts (a budget ratio is a share of those)
    pool: tuple[PoolDevice, ...] = (PoolDevice("CPU", Budget(ratio=DEFAULT_BUDGET_RATIO)),)
    # prompts' experts through the pool (patch 0016); AUTO resolved against pool[0] when the pool opens
    stream_prefill: StreamPrefill = option("--stream-prefill", default=StreamPrefill.AUTO, cli_type=str,
                                           check=one_of(StreamPrefill), help=(
        "prompt passes of more than 64 tokens compute their experts on the pool device: "
        "ahead (copy every non-resident expert of the next layer while one computes), used (copy the experts a "
        "layer's router chose, once it has run), off (llama.cpp's prefill), auto (ahead on a GPU or RPC pool, off "
        "on --device CPU)"))
    tensor_split: tuple[float, ...] = ()  # llama.cpp's --tensor-split over the pool's devices (() = by free memory)
    ablations: Ablations = field(default_factory=Ablations)
    miss_rule: MissRule = option("--miss-rule", default=MissRule.HOST, cli_type=str, check=one_of(MissRule), help=(
        "where a pass computes an expert the pool lacks: host (on the host; the pool follows the plan made after "
        "each step), reuse (decided at each layer once its router has run: uploaded into a slot, computed on the "
        "host or streamed once, by the measured costs and how often the expert is used; the pool is a cache)"))
    # batches of up to EXACT_ROWS tokens (gamma + 1 if larger) computed row by row as one token
    # is (ggml-cpu's batch-invariant mode, patch 0022): verify passes give exactly the one-token logits
    exact: bool = option("--exact/--no-exact", default=True, help=(
        "host matmuls and attention of up to 32 tokens (--draft-max + 1 if more) compute every row as "
        "one token does, so speculative greedy output is exactly target-only's on the host (a verify pass's dense "
        "weights then take one-row kernels); --no-exact: llama.cpp's kernels in llama.cpp's layouts, as stock llama.cpp "
        "computes, faster verify passes whose rounding may turn a near-tie into another token"))
    check_tensors: bool = option("--check-tensors", default=False,
                                 help="check the model's tensor data for NaN/Inf on load (as llama.cpp's)")
    mmap: bool = option("--mmap/--no-mmap", default=True, help=(
        "map the model file (llama.cpp's default); --no-mmap reads the host weights into "
        "memory: with a GPU into its pinned host buffers, which the expert pool and op offload copy from several "
        "times faster (H100: 55 against 6.3 GB/s); without a GPU it only costs the plain-layout prompt kernels "
        "of repacked types (they read the mapping)"))
    pin_mapping: bool = option("--pin-mapping", default=False, help=(
        "register the mapped file's experts as the pool GPU's pinned host memory, so that the pool "
        "copies them at the pinned rate without --no-mmap's second copy of the weights; reads in and pins that "
        "whole range at load (off by default: not yet measured on a GPU); said in the log where the device cannot"))
    mlock: bool = option("--mlock", default=False, help=(
        "lock the weights in memory (llama.cpp's --mlock); with the experts on the disk (a model larger than "
        "--host-budget), the other weights only"))
    host_budget: str | None = option("--host-budget", default=None, show_default=False, check=check_host_budget, help=(
        "host memory for the model's weights: bytes (48G) or a share of the memory available now (80%) "
        "\\[default: what is available now, less an eighth]. A file larger than this keeps its routed experts on the "
        "disk: the host holds the best-ranked ones, the others are read when used or ahead of the pass that uses them"))
    disk_read_ahead: bool = option("--disk-read-ahead/--no-disk-read-ahead", default=True, help=(
        "with the experts on the disk, read ahead after every pass the experts the next pass will likely use "
        "(its own choices, ranked, and the draft's); --no-disk-read-ahead: read an expert only when a pass uses it"))
    host_tiers: HostTiers | None = None  # resolved from --host-budget before loading (cli/setup.py); None: all in memory
    recalibrate: bool = option("--recalibrate", default=False, help="measure the unit costs again")
    calibration_cache: str | Path | None = None  # default: calibrate.cache_path()
    verbose: bool = option("--verbose", default=False, help="llama.cpp logs")

    def __post_init__(self) -> None:
        self.draft = Draft.of(self.draft)
        self.repack = Repack.of(self.repack)
        self.stream_prefill = StreamPrefill(self.stream_prefill)  # AUTO is resolved where the pool opens
        self.miss_rule = MissRule(self.miss_rule)


@dataclass
class Completion:
    text: str
    tokens: list[int]
    metrics: RunMetrics


class Session:
    """Target (+ draft) (+ expert engine): one sequence, generated step by step.

    `generate` streams text; `complete` returns a Completion; `close` frees everything native
    (engine first: its copy worker references the target context)."""

    def __init__(self, cfg: SessionConfig, policy: Policy | None = None) -> None:
        """policy: what decides the plans when the engine is on (default: MoE-SpAc with the
        config's ablations); any `orchestrator.policies` Policy whose misses run on the host."""
        self.cfg = cfg
        self.engine = self.routing = self.calibration = None
        self.host_tier: HostTier | None = None  # the experts kept in memory when they are on the disk
        self.tier_routing: Routing | None = None
        self.draft_routing = None  # routing export of an MoE draft of the target's shape (lookahead)
        self.last_draft_routing: np.ndarray | None = None  # [n_drafted, n_layer, top_k] of the last step
        self.policy = policy
        self.draft = self.draft_ctx = None
        self.draft_kind = DraftKind.NONE  # what drafts now (NONE once a draft is dropped)
        self.engine_note = ""
        # the engine places the experts itself at each layer, instead of plans: llama.cpp's
        # upload-on-miss LRU (patch 0023) or spac's miss rule (patch 0031)
        self._engine_places = False
        self._models: list[Model] = []
        self._contexts: list[Context] = []
        self._tokens: list[int] = []
        self._pieces: dict[int, bytes | None] = {}  # token → its bytes, None: end of generation
        self._plan_in_force: Plan | None = None
        self._plan_sent: Plan | None = None
        self._stats_prev: dict | None = None
        self.on_step: Callable[[StepRouting], None] | None = None  # e.g. a TraceWriter's append
        # a prompt pass's routing, [n_tokens, n_layer, top_k] (its last ubatch): a TraceWriter's append_prompt
        self.on_prompt: Callable[[np.ndarray], None] | None = None
        # called after every verification step with its seconds; may raise to end the generation
        # there (a server's client went away): `generate`'s cleanup runs, the KV caches stay valid
        self.on_verify_step: Callable[[float], None] | None = None
        self.last_metrics: RunMetrics | None = None
        self.last_text = ""
        self.last_tokens: list[int] = []  # ids of the last generation's tokens (an ending EOG token included)
        try:
            self._open(cfg)
        except BaseException:
            self.close()
            raise
        if self.engine is None:
            self.policy = None
        k_max = self.policy.estimator.k_max if hasattr(self.policy, "estimator") else cfg.k_max
        self.recorder = RunRecorder(self.engine.n_moe_layers if self.engine else 0,
                                    self.engine.n_expert if self.engine else 0, k_max, mode=self.mode)

    def _open(self, cfg: SessionConfig) -> None:
        ab = cfg.ablations
        # process-wide, and the same with a draft or without and for any γ up to 31: a short prompt
        # is such a batch too, and target-only output is the reference
        set_batch_invariant_rows(max(EXACT_ROWS, cfg.gamma + 1) if cfg.exact else 0)
        on_gpu = not cfg.pool[0].on_host  # CPU: the test device, a second host buffer
        kind = DraftKind.NONE if ab.no_sd else cfg.draft.kind
        mtp = kind is DraftKind.MTP
        self.target = self._model(cfg.model, cfg.n_gpu_layers,
                                  devices=tuple(d.name for d in cfg.pool) if on_gpu else (),
                                  tensor_split=cfg.tensor_split if on_gpu else (), mtp=mtp,
                                  experts_on_disk=cfg.host_tiers is not None and cfg.host_tiers.on_disk)
        if kind is DraftKind.POOL:
            self.draft = self.target if self.target.n_expert and cfg.expert_engine is not False else None
        elif kind is DraftKind.MTP:  # the head is the target's: its model, its vocabulary
            require_mtp(self.target)
            self.draft = self.target
        elif kind is DraftKind.FILE:
            self.draft = self._model(cfg.draft.path, cfg.n_gpu_layers_draft)
            check_vocab(self.target, self.draft)
        # the kind of draft in force (NONE once dropped): what the loop asks, never `draft is target`
        self.draft_kind = kind if self.draft is not None else DraftKind.NONE
        n_batch = max(cfg.n_batch, cfg.gamma + 1)
        trained = self.target.meta(f"{self.target.arch}.context_length")
        self.n_ctx = cfg.n_ctx or int(trained or 4096)
        # a verify pass rejects at most γ drafts: a recurrent state keeps that many snapshots
        self.ctx = self._context(self.target, self.n_ctx, n_batch, cfg.n_threads,
                                 rollback=cfg.gamma if self.draft is not None else 0)
        self.gamma_note = ""
        if self.draft is not None and self.ctx.rollback < cfg.gamma:
            self._drop_draft()
            self.gamma_note = (f"γ=0: the {self.target.arch} recurrent state of {self.target.path.name} "
                               "cannot be rolled back (llama.cpp keeps no snapshots of it)")
        if mtp and self.draft is not None:
            self.draft_ctx = MtpDraft(self.target, self.ctx, n_batch, cfg.n_threads)
            self._contexts.append(self.draft_ctx)
        elif self.draft is not None:  # a pool draft's compute buffers: sized for drafting, not prefill
            self.draft_ctx = self._context(self.draft, self.n_ctx, max(cfg.gamma + 1, 16) if kind is DraftKind.POOL
                                           else n_batch, cfg.n_threads, forks=True)
        self.mode = "speculative" if self.draft is not None else "autoregressive"
        self.gamma = cfg.gamma if self.draft is not None else 0
        self.governor = (Governor(GovernorConfig(gamma_max=self.gamma, gamma_min=min(cfg.gamma_min, self.gamma)))
                         if cfg.adaptive_gamma and self.gamma else None)
        self.chat_template = ChatTemplate.from_model(self.target)
        if cfg.expert_engine is not False and self.target.n_expert:
            self._open_engine(cfg)
        elif cfg.expert_engine and not self.target.n_expert:
            self.engine_note = f"expert engine off: {self.target.path.name} has no routed experts"
        if kind is DraftKind.POOL and self.engine is None:  # no pool, no pool draft: decode autoregressively
            self._drop_draft()
        if cfg.host_tiers is not None and cfg.host_tiers.on_disk:
            self._open_host_tier(cfg.host_tiers)
            if self.engine is None:  # no pool: a draft of the target's shape still names what to read ahead
                self._open_draft_routing()

    def _model(self, path, n_gpu_layers: int, devices: tuple[str, ...] = (), tensor_split: tuple[float, ...] = (),
               mtp: bool = False, experts_on_disk: bool = False) -> Model:
        m = Model(path, n_gpu_layers=n_gpu_layers, repack=self.cfg.repack, n_threads=self.cfg.n_threads,
                  verbose=self.cfg.verbose, check_tensors=self.cfg.check_tensors, mmap=self.cfg.mmap, devices=devices,
                  tensor_split=tensor_split, mtp=mtp, exact=self.cfg.exact, experts_on_disk=experts_on_disk,
                  mlock=self.cfg.mlock)
        self._models.append(m)
        return m

    def _context(self, model: Model, n_ctx: int, n_batch: int, n_threads: int, rollback: int = 0,
                 forks: bool = False) -> Context:
        c = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, rollback=rollback, forks=forks)
        self._contexts.append(c)
        return c

    def _drop_draft(self) -> None:
        """Decode autoregressively: the draft (and its context, if made) closed."""
        if self.draft_ctx is not None:
            self._contexts.remove(self.draft_ctx)
            self.draft_ctx.close()
        if self.draft_kind is DraftKind.FILE:
            self._models.remove(self.draft)
            self.draft.close()
        self.draft = self.draft_ctx = None
        self.draft_kind = DraftKind.NONE
        self.mode, self.gamma = "autoregressive", 0

    def _open_engine(self, cfg: SessionConfig) -> None:
        if self.policy is None:
            self.policy = spac_policy(cfg.ablations, cfg.k_max, cfg.lam, cfg.miss_rule)
        # llama.cpp's own expert cache (policies.cache.LlamaMoeCacheLRU) runs in the engine itself
        # (patch 0023): each layer uploads its misses into LRU slots; spac's miss rule
        # (policies.cache.ReuseCredited, patch 0031) decides each miss in a gate after the router.
        # The session sends no plans to either
        native_cache = bool(self.policy.readback_max_tokens) and not getattr(self.policy, "per_layer", False)
        miss_gate = self.policy.gate_readback
        self._engine_places = native_cache or miss_gate
        if native_cache and self.policy.name != "llama-moe-cache-lru":
            raise ValueError(f"policy {self.policy.name}: the engine runs llama.cpp's cache with its plain LRU "
                             "and no CPU share only (llama-moe-cache-lru); the other rules are the simulator's")
        try:
            engine_args = dict(no_evict=cfg.ablations.no_evict or not self.policy.evicts, stream_prefill=cfg.stream_prefill.resolve(cfg.pool[0]),
                               upload_on_miss_tokens=self.policy.readback_max_tokens if native_cache else 0,
                               miss_gate_tokens=MISS_MAX_TOKENS if miss_gate else 0, pin_mapping=cfg.pin_mapping)
            if len(cfg.pool) > 1:  # one pool per device, on the layers llama.cpp placed there
                n = self.target.n_layer
                layers = pool_layer_ranges(model_layer_devices(self.target.ptr, n), [d.name for d in cfg.pool],
                                           model_moe_layers(self.target.ptr, n))
                devices = tuple(replace(d, layers=span) for d, span in zip(cfg.pool, layers))
                self.engine = SeveralPools(self.ctx.ptr, self.target.path, devices, **engine_args)
            else:
                one = cfg.pool[0]
                self.engine = ExpertEngine(self.ctx.ptr, self.target.path, device=one.name, budget_bytes=one.budget.nbytes,
                                           budget_ratio=one.budget.ratio, **engine_args)
        except (NativeError, PlacementError) as e:
            if cfg.expert_engine:
                raise
            self.engine_note = f"expert engine off: {e}"
            return
        if self.draft_kind is DraftKind.POOL:
            self.engine.attach_draft(self.draft_ctx.ptr)
        self.routing = Routing(self.ctx.ptr, self.engine.n_expert_used)
        self._open_draft_routing()
        lookahead = self.draft_routing is not None or self.policy.draft_optional
        if ((self.policy.miss != "cpu" and not self._engine_places) or (self.policy.uses_draft_routing and not lookahead)
                or self.policy.needs_future):
            raise ValueError(f"policy {self.policy.name!r} cannot drive the live engine (it computes misses "
                             "on the host, from the target's routing and an MoE draft's)")
        stats = self.engine.stats()
        self.policy.reset(PolicyContext(n_layer=self.engine.n_moe_layers, n_expert=self.engine.n_expert,
                                        top_k=self.engine.n_expert_used, capacity=int(stats["n_slots"]), gamma=self.gamma,
                                        devices=self._device_spans(stats)))
        self._calibrate(force=cfg.recalibrate)

    def _open_host_tier(self, tiers: HostTiers) -> None:
        """The experts kept in memory of a target whose experts are on the disk (runtime/host_tier.py),
        fed the routing of every target pass."""
        n_used = int(self.target.meta(f"{self.target.arch}.expert_used_count") or 0)
        self.tier_routing = self.routing or Routing(self.ctx.ptr, n_used)
        self.host_tier = HostTier(ExpertsOnDisk(self.target.ptr), self.tier_routing.n_moe_layers, self.target.n_expert,
                                  capacity=tiers.n_kept, read_ahead=self.cfg.disk_read_ahead)

    def _after_target_pass(self) -> None:
        if self.host_tier is not None:
            self.host_tier.after_pass(self.tier_routing.last()[0], self._resident() if self.engine is not None else None)

    def _device_spans(self, stats: dict) -> tuple[tuple[int, int, int], ...]:
        """PolicyContext.devices: each pool device's MoE layers and slots (() for one device)."""
        if not isinstance(self.engine, SeveralPools):
            return ()
        return tuple((*engine.moe_range, int(row["n_slots"])) for engine, row in zip(self.engine.engines, stats["per_device"]))

    def _calibrate(self, force: bool) -> None:
        """Measure (or load) the unit costs, then start the plans over: the measurement drove the
        pool itself and left it wanting nothing, so the policy's first plan is sent whatever was
        sent before, and the copies made while measuring are not counted in the next step's feedback."""
        cfg = self.cfg
        rig = calibrate.Rig(engine=self.engine, routing=self.routing, ctx=self.ctx, draft_ctx=self.draft_ctx,
                            model_path=self.target.path, draft_path=self.draft.path if self.draft else None,
                            device=",".join(d.name for d in cfg.pool), n_threads=cfg.n_threads,
                            budget=",".join(str(d.budget.nbytes or d.budget.ratio) for d in cfg.pool),
                            gamma=self.gamma, k_max=cfg.k_max,
                            draft_kind=self.draft_kind.value if self.draft_kind in (DraftKind.POOL, DraftKind.MTP) else "",
                            miss_gate=bool(self.policy.gate_readback))
        self.calibration = cal = calibrate.load_or_calibrate(rig, force=force, path=cfg.calibration_cache)
        if self.policy.gate_readback:  # spac's miss rule decides on the measured unit costs
            self.engine.set_miss_costs(MissCosts(
                upload_s=cal.t_upload_unit or cal.t_io_unit, sync_s=0.0, horizon_tokens=getattr(self.policy, "horizon", 0.0),
                host_s=lambda n: n * cal.t_cpu_unit, device_s=lambda n: n * cal.t_gpu_unit))
        self._plan_sent = self._plan_in_force = None
        # initial placement, with the calibration as the first measurement
        self._send(self.policy.plan(None, self._resident(), self.calibration.feedback()))
        self.engine.reset_stats()
        self._stats_prev = self.engine.stats()
        self.ctx.n_replays = 0  # the measurement's trims of whole batches are not the run's

    def _open_draft_routing(self) -> None:
        """An MoE draft with the target's experts (the quantised self-draft) routes the tokens it
        drafts: export that routing too, a lookahead for the next verify pass (the pool's plans
        and the host tier's reads ahead)."""
        d, t = self.draft, self.target
        # an MTP head's MoE layer is its own, not one of the target's: no lookahead from it
        if self.draft_kind is DraftKind.MTP or d is None or self.draft_ctx is None or d.n_expert != t.n_expert:
            return
        key = "{}.expert_used_count"
        if d.meta(key.format(d.arch)) != t.meta(key.format(t.arch)):
            return
        target_routing = self.routing if self.engine is not None else self.tier_routing
        routing = Routing(self.draft_ctx.ptr, target_routing.n_expert_used)
        if routing.n_moe_layers == target_routing.n_moe_layers:
            self.draft_routing = routing
        else:
            routing.disable()

    def _drafted(self, rows: list[np.ndarray]) -> None:
        """After each draft token: keep the draft's routing of the token it consumed and let a
        lookahead policy add prefetches while the draft goes on."""
        # [n_layer, n_tokens, top_k], the consumed token last; a pool draft routes only among the
        # resident experts, so its lookahead is what its router would have chosen unmasked
        ids = self.draft_routing.unmasked() if self.draft_kind is DraftKind.POOL else self.draft_routing.last()[0]
        rows.append(ids[:, -1, :].copy())
        if self.host_tier is not None:  # the verify pass will likely use these: read them while the draft goes on
            self.host_tier.lookahead(ids[:, -1:, :])
        if self.engine is not None and self.policy.uses_draft_routing:
            plan = self.policy.draft_plan(np.stack(rows), self._resident())
            if plan is not None:
                self._send(plan)

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.target.tokenize(text, add_special=True)

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        """The conversation as prompt tokens: the GGUF's chat template, else one running text."""
        if self.chat_template is None:
            return self.target.tokenize("".join(m["content"] for m in messages), add_special=True)
        return self.chat_template.tokens(self.target, messages)

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 128, stop: Sequence[str] = (),
                 sampling: SamplingParams = SamplingParams()) -> Completion:
        text = "".join(self.generate(prompt, max_tokens, stop, sampling))
        return Completion(text, list(self.last_tokens), self.last_metrics)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, stop: Sequence[str] = (),
                 sampling: SamplingParams = SamplingParams(),
                 stop_requested: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Stream the text of up to max_tokens new tokens; metrics in `last_metrics` at the end.

        Stops at an end-of-generation token (not part of the text), at a stop string (text cut
        before it), at max_tokens, when the context is full, or once stop_requested() (asked
        before each step: a noted Ctrl-C, `runtime.llm.sigint_noted`) with reason "interrupted"."""
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not prompt_tokens:
            raise ValueError("empty prompt (and the model adds no BOS token)")
        if len(prompt_tokens) >= self.n_ctx:
            raise ModelError(f"prompt of {len(prompt_tokens)} tokens does not fit the context ({self.n_ctx})")
        rng = np.random.default_rng(sampling.seed)
        rec = self.recorder
        rec.start(len(prompt_tokens), self.engine.stats() if self.engine else None)
        stream = TextStream(stop)
        pieces = self._pieces
        reason = "interrupted"
        n_out = 0
        try:
            rec.metrics.n_prompt_cached, first = self._prefill(prompt_tokens, sampling, rng)
            rec.prefill_done()
            reason = "length"
            pending = [first]  # the prompt pass's own next token
            while n_out < max_tokens:
                if stop_requested():
                    reason = "interrupted"
                    break
                room = self.n_ctx - len(self._tokens)
                if room < 1:
                    reason = "context"
                    break
                if pending is not None:
                    new, pending = pending, None
                else:
                    # γ from measured times only when greedy: sampling consumes the seeded random
                    # stream per drafted token, so the same seed must see the same γ to give the same text
                    adaptive = self.governor is not None and sampling.greedy
                    gamma = self.governor.next_gamma() if adaptive else self.gamma
                    gamma = min(gamma, max_tokens - n_out - 1, room - 1)
                    t_step = time.perf_counter()
                    if gamma > 0:
                        n_drafted, n_accepted, new = self._step(gamma, sampling, rng)
                    else:
                        n_drafted = n_accepted = 0
                        new = [self._plain_step(sampling, rng)]
                    rec.step(n_drafted, n_accepted)
                    if self.on_verify_step is not None:
                        self.on_verify_step(time.perf_counter() - t_step)
                kept, chunk = 0, []
                for t in new:
                    kept += 1
                    piece = pieces[t] if t in pieces else self._piece(t)
                    if piece is None:
                        reason = "eos"
                        break
                    chunk.append(stream.push(piece))
                    if stream.stopped:
                        reason = "stop"
                        break
                kept = min(kept, max_tokens - n_out)
                self._accept(new[:kept])
                n_out += kept
                rec.emitted(kept)
                if self.engine is not None:
                    rec.engine_stats(self.engine.stats())
                text = "".join(chunk)
                if text:
                    yield text
                if reason in ("eos", "stop"):
                    break
            tail = stream.flush()
            if tail:
                yield tail
        finally:
            self._sync()
            self.ctx.checkpoint()  # a recurrent state: the next turn's prompt may leave this one
            self.last_metrics = rec.finish(reason, self.engine.stats() if self.engine else None)
            self.last_text = stream.text
            self.last_tokens = self._tokens[len(prompt_tokens):]

    def _piece(self, token: int) -> bytes | None:
        """The token's bytes (None: an end-of-generation token), asked of llama.cpp once."""
        piece = self._pieces[token] = None if self.target.is_eog(token) else self.target.piece(token)
        return piece

    # -- one step ---------------------------------------------------------------------------

    def _step(self, gamma: int, sampling: SamplingParams, rng) -> tuple[int, int, list[int]]:
        """One verification step (or one autoregressive decode): (drafted, accepted, new tokens).

        Leaves the target's KV cache holding tokens + the accepted drafts."""
        tokens, ctx, dctx = self._tokens, self.ctx, self.draft_ctx
        greedy = sampling.greedy
        drafts: list[int] = []
        q: list[np.ndarray] = []
        t0 = time.perf_counter()
        draft_rows: list[np.ndarray] = []
        lookahead = self.draft_routing is not None
        if gamma > 0 and dctx is not None:
            feed = tokens[dctx.n_past:]
            is_eog = self.draft.is_eog
            for i in range(gamma):
                if i == 1 and dctx.forks:  # drafts of a recurrent draft: in a scratch sequence
                    dctx.fork()
                # with the lookahead every fed token gets its logits, so that upstream routes it
                # through the last layer too (the routing of a catch-up decode's last token)
                dctx.decode(feed, logits_all=lookahead)
                if lookahead:
                    self._drafted(draft_rows)
                row = dctx.logits()[-1]
                if greedy:
                    d = int(row.argmax())
                else:
                    qd = distribution(row, sampling)
                    d = sample(qd, rng)
                    q.append(qd)
                drafts.append(d)
                if is_eog(d):
                    break
                feed = (d,)
        t1 = time.perf_counter()
        base = len(tokens)
        ctx.decode([tokens[-1], *drafts], logits_all=True)
        self._after_target_pass()
        logits = ctx.logits()
        if greedy:
            a, nxt = verify_greedy(drafts, logits)
        else:
            a, nxt = verify_sampled(drafts, q, logits, sampling, rng)
        t2 = time.perf_counter()
        ctx.trim(base + a)
        if dctx is not None and dctx.forks:
            dctx.join()  # back to tokens[:base]; the next step's catch-up decodes the accepted drafts
        elif dctx is not None:
            dctx.trim(min(dctx.n_past, base + min(a, max(len(drafts) - 1, 0))))
        if self.engine is not None:
            if lookahead:
                shape = (0, self.engine.n_moe_layers, self.engine.n_expert_used)
                self.last_draft_routing = np.stack(draft_rows) if draft_rows else np.zeros(shape, np.int32)
            self._after_verify(len(drafts), a, t1 - t0, t2 - t1)
        if self.governor is not None:
            self.governor.observe(len(drafts), a, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return len(drafts), a, [*drafts[:a], nxt]

    def _plain_step(self, sampling: SamplingParams, rng) -> int:
        """γ = 0: one decode of the target, as a target-only loop runs it (no draft, nothing to
        verify or trim); the target's next token. The governor still times it, and with an
        engine the policy still sees its routing."""
        t0 = time.perf_counter()
        self.ctx.decode(self._tokens[-1:])
        self._after_target_pass()
        row = self.ctx.logits()[-1]
        nxt = int(row.argmax()) if sampling.greedy else sample(distribution(row, sampling), rng)
        t1 = time.perf_counter()
        if self.engine is not None:
            if self.draft_routing is not None:
                self.last_draft_routing = np.zeros((0, self.engine.n_moe_layers, self.engine.n_expert_used), np.int32)
            self._after_verify(0, 0, 0.0, t1 - t0)
        if self.governor is not None:
            self.governor.observe(0, 0, 0.0, t1 - t0, time.perf_counter() - t1)
        return nxt

    def _after_verify(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        """Routing of the verify pass → policy → plan, handed to the engine before drafting."""
        t0 = time.perf_counter()
        ids, weights = self.routing.last()
        # the cache now holds what it held before the pass plus the accepted drafts and the pass's first token
        routing = StepRouting(selected=ids.transpose(1, 0, 2), weights=weights.transpose(1, 0, 2),
                              n_drafted=n_drafted, n_accepted=n_accepted, position=self.ctx.n_past - n_accepted - 1)
        if not self._engine_places:  # the engine decides at each layer: nothing to plan
            self._plan_step(routing, draft_s, verify_s, t0)
        if self.on_step is not None:
            self.on_step(StepRouting(selected=routing.selected.copy(), weights=routing.weights.copy(),
                                     n_drafted=n_drafted, n_accepted=n_accepted, position=routing.position))

    def _plan_step(self, routing: StepRouting, draft_s: float, verify_s: float, t0: float) -> None:
        policy, engine = self.policy, self.engine
        if self._plan_in_force is not None:
            self.recorder.hot_cold(self._plan_in_force.utility, self._plan_in_force.threshold,
                                   routing.frequency(engine.n_expert))
        if self._observes:
            observe(policy, routing, engine.n_expert)
        plan = policy.plan(routing, self._resident(), self._feedback(routing.n_drafted, draft_s, verify_s))
        self._send(plan)
        self._plan_in_force = plan
        self.recorder.plan(plan.threshold, time.perf_counter() - t0)

    @property
    def _observes(self) -> bool:
        return type(self.policy).on_layer is not Policy.on_layer

    def _resident(self) -> np.ndarray:
        return self.engine.residency() >= 0

    def _send(self, plan: Plan) -> None:
        if self._engine_places:
            return
        if plan is not self._plan_sent:  # a static plan is sent once
            self.engine.set_plan(plan)
            self._plan_sent = plan

    def _feedback(self, n_drafted: int, draft_s: float, verify_s: float) -> Feedback:
        """This step's measurements: the verify time spread over the MoE layers, the draft time
        per token, the copy time per expert (engine stats); the unit compute times stay those of
        the calibration (NaN: no new sample)."""
        s, prev = self.engine.stats(), self._stats_prev
        self._stats_prev = s

        def t_io(now: dict, then: dict) -> float:
            n_copies = now["n_copies"] - then["n_copies"]
            return (now["copy_busy_us"] - then["copy_busy_us"]) * 1e-6 / n_copies if n_copies > 0 else np.nan

        n_layer = self.engine.n_moe_layers
        devices = list(zip(s["per_device"], prev["per_device"]))
        return Feedback(
            t_cpu_unit=np.nan, t_gpu_unit=np.nan, t_io_unit=t_io(s, prev),
            t_draft_token=draft_s / n_drafted if n_drafted else np.nan,
            t_layer=np.full(n_layer, verify_s / n_layer), expert_bytes=self.calibration.expert_bytes,
            free_slots=int(s["n_slots"] - s["n_resident"]), n_drafted=n_drafted,
            copies_block_device=copies_block_compute(self.cfg.pool[0].name),
            free_slots_per_device=tuple(int(now["n_slots"] - now["n_resident"]) for now, _ in devices),
            t_io_per_device=tuple(t_io(now, then) for now, then in devices),
            copies_block_per_device=tuple(copies_block_compute(now["device"]) for now, _ in devices))

    # -- KV bookkeeping ---------------------------------------------------------------------

    def _prefill(self, prompt: list[int], sampling: SamplingParams, rng) -> tuple[int, int]:
        """Target KV := prompt, draft KV := prompt[:-1], reusing what is cached; the first new
        token comes from the logits of the prompt's last position, computed in the same pass as
        the rest of the prompt, as llama.cpp does it: decoding the last prompt token on its own
        rounds differently in kernels whose order of summation depends on the batch (repacked and
        tiled quantized matmuls, F16 GEMM), and real files then drift from llama.cpp's output.
        Returns (how many prompt tokens the target's cache already held, the first new token)."""
        common = 0
        for a, b in zip(self._tokens, prompt):
            if a != b:
                break
            common += 1
        keep = min(common, len(prompt) - 1)  # the last prompt token is always computed: its logits
        # a recurrent state goes back only as far as a snapshot or a checkpoint reaches
        keep = self.ctx.reusable(keep)
        dctx = self.draft_ctx
        if dctx is not None:
            dctx.trim(dctx.reusable(keep))
        self._tokens = list(prompt[:keep + 1])  # the KV caches hold tokens[:-1]
        self._sync()
        self._tokens = list(prompt)
        cached = self.ctx.n_past
        # the draft first: the target decodes next, and its weights should be the ones in the cache
        # (an MTP head reads the target's hidden states of the prompt: it catches up in the first step)
        if dctx is not None and self.draft_kind is not DraftKind.MTP and dctx.n_past < len(prompt) - 1:
            dctx.decode(prompt[dctx.n_past:-1], logits_all=False)
            dctx.checkpoint()
        self.ctx.decode(prompt[self.ctx.n_past:], logits_all=False)
        self._after_target_pass()
        if self.on_prompt is not None and self.routing is not None:
            self.on_prompt(self.routing.last()[0].transpose(1, 0, 2).copy())
        self.ctx.checkpoint()  # a recurrent state: the next prompt may leave this one after its end
        row = self.ctx.logits()[-1]
        first = int(row.argmax()) if sampling.greedy else sample(distribution(row, sampling), rng)
        return cached, first

    def _accept(self, new: list[int]) -> None:
        self._tokens.extend(new)
        self._sync(force=False)

    def _sync(self, force: bool = True) -> None:
        """Make the KV caches a prefix of tokens[:-1] again (after an interruption too: with
        force, positions past n_past are removed as well, in case a decode ended unrecorded)."""
        n = max(len(self._tokens) - 1, 0)
        for c in (self.ctx, self.draft_ctx):
            if c is None or not c.ptr:
                continue
            c.trim(min(c.n_past, n), force=force)

    def reset(self) -> None:
        """Forget the cached sequence (both KV caches emptied)."""
        self._tokens = []
        for c in (self.ctx, self.draft_ctx):
            if c is not None:
                c.clear()

    def recalibrate(self) -> None:
        """Measure the unit costs again (and refresh the cache file)."""
        if self.engine is None:
            return
        self.reset()
        self._calibrate(force=True)

    def close(self) -> None:
        """Stop the engine's copy worker, then free contexts and models. Safe to call twice."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        for c in getattr(self, "_contexts", []):
            c.close()
        for m in getattr(self, "_models", []):
            m.close()
        self._contexts, self._models = [], []

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
