"""Replay a routing trace through a policy under a hardware cost model.

One verification step, as in MoE-SpAc Fig. 3 (times from `profiles.CostModel`):

    drafting   γ draft tokens on the device; the copy engine runs meanwhile, serving the plan
               the policy made after the previous pass (one PCIe link, copies back to back)
    verify     the dense blocks and output head, then per MoE layer in order (non-expert times
               grow with the pass's tokens, and attention with the tokens cached before it
               when the trace records them, where the profile is measured):
                 dense part of the block
                 device half: every needed expert that is on the device, one call per
                   distinct expert (time by its token count)
                 host half: the other needed experts, per (token, expert) — in parallel with
                   the device half, plus one hidden-state round trip (sync) when non-empty
                   (measured profiles: in every layer, as the engine's split graph crosses in
                   every layer; and the device also multiplies the host experts' tokens by its
                   all-zero slot, one expert's worth)
                 layer time = max(device half, host half + sync)
               With miss mode "fetch" the layer instead copies each missing expert on demand
               and computes it on the device when it arrives; "greedy" splits the missing
               experts between a copy and the host (HybriMoE), see `_greedy`; decided in the
               engine's gate (`gate_readback`, spac's miss rule) both halves start once the
               gate's uploads have landed, as the gate returns only then. A readback
               cache (`Policy.readback_max_tokens`: llama.cpp's llama-moe-cache) first reads
               the router's choice back (one sync), uploads the misses, then computes every
               routed expert in one op; a pass of more tokens runs the layer on the host.
    plan       the policy sees the pass (on_layer, layer by layer; plan at the end)

A new plan replaces the copy queue, as in the engine: copies not started by then are dropped. A
device whose copies run on its compute thread (an RPC server: `copy_blocks_device`) interleaves
them with a pass: a pass lasts at least its device work plus the copy in flight (stall).

A model larger than the host RAM (`SimConfig.host_ram`): a host tier (host_tier.py) holds the
experts that fit, the rest are on the disk. A layer's misses (host compute, or copies to the
device) wait until those of them on the disk are in host memory, and the device's copies read
from the tier too. spac's policies get the live tier (ranked by use, exclusive of the device
pool, reading ahead after each pass and each draft token), the others fault experts in as
llama.cpp's mmap does.

An expert counts as on the device for a layer when its slot was claimed before the pass and
its copy has completed: before the pass starts (visibility "pass", the spac engine: residency
maps are set once per ubatch) or before the layer starts (visibility "layer", MoE-SpAc Fig. 3).
Slots are claimed when a plan is applied, so the pool never holds more than `capacity`
experts. Experts copied inside the pass ("fetch", "greedy") count as misses.

Outputs: hit rate (token-weighted share of expert computations served from the pool, and the
share of distinct experts), host share, collision misses (resident when the pass began,
evicted by an in-pass copy, then needed later in the same pass), bytes moved, step time,
tokens/s (tokens = accepted drafts + 1 per step).

Why ~670 lines: the pool (slots, LRU order, in-pass copies and collisions) and the step's
timing under the cost model are replayed together, pass by pass, with the host tier's reads
where the model is larger than the RAM; the costs themselves are profiles.py, the host tier
host_tier.py, the policies orchestrator.policies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from orchestrator.policies.base import Feedback, Policy, PolicyContext, layer_usage, order_rows
from orchestrator.policies.plan import Plan, StepRouting
from orchestrator.sim import profiles
from orchestrator.sim.disk import FAULT_THREADS
from orchestrator.sim.host_tier import PageCache, RankedTier, host_slots
from orchestrator.sim.profiles import CostModel
from orchestrator.sim.trace import Trace


@dataclass(frozen=True)
class SimConfig:
    hardware: str = "rtx4090"
    model: str = "qwen3-30b-a3b"
    draft: str | None = "qwen3-4b"   # draft model profile, or "pool" / "mtp" (profiles.SELF_DRAFTS); None: free drafting
    quant: str = "Q4_K"
    draft_quant: str = "Q8_0"
    cache_ratio: float = 0.17        # expert-pool slots / all experts
    capacity: int | None = None      # slots, overrides cache_ratio
    visibility: str = "pass"         # "pass" | "layer"
    context: int = 4096              # tokens of KV cache counted in the memory budget
    snapshots: int = 0               # a hybrid target's recurrent-state snapshots (llama.cpp's n_rs_seq; spac: γ)
    # models larger than RAM (host_tier.py): the host RAM the run may use (None: unlimited, every
    # expert in RAM), the disk below it (a preset of hardware.toml; None: the hardware's own, else
    # profiles.DEFAULT_DISK), what spac's tier reads ahead ("ranked": what ranks in, as live; "none":
    # nothing, it only keeps and drops; "next-pass": an oracle, the next pass's experts first), how it
    # ranks ("uses": the live tier's decayed counts; "utility": the policy's scores, an ablation),
    # whether it leaves out the device pool's experts (as live; False: the inclusive ablation), and
    # llama.cpp's faulting threads
    host_ram: float | None = None
    disk: str | None = None
    read_ahead: str = "ranked"
    host_rank: str = "uses"
    host_exclusive: bool = True
    fault_threads: int = FAULT_THREADS
    # the trace's first steps are a live run's warm-up (bench_sim_truth.py): replayed, not timed or
    # counted; the timed steps start once their copies are done, as live after `wait_idle`
    warm_up_steps: int = 0

    def costs(self) -> CostModel:
        """hardware: a datasheet profile's key, or a measured profile's file (`spac sim profile measure`)."""
        draft = self.draft if self.draft is None or self.draft in profiles.SELF_DRAFTS else profiles.model(self.draft)
        if profiles.is_measured(self.hardware):
            costs = CostModel.from_measured(profiles.read_measured(self.hardware), profiles.model(self.model), draft,
                                            self.quant, self.draft_quant, self.context,
                                            draft_file=draft.source if isinstance(draft, profiles.ModelProfile) else None,
                                            snapshots=self.snapshots)
        else:
            costs = CostModel.build(profiles.hardware(self.hardware), profiles.model(self.model), draft,
                                    self.quant, self.draft_quant, self.context, snapshots=self.snapshots)
        return costs if self.disk is None else replace(costs, disk=profiles.disk(self.disk))


@dataclass
class SimResult:
    policy: str
    capacity: int
    n_steps: int
    tokens: int
    time_s: float
    hit_rate: float            # token-weighted: expert computations served from the pool
    unique_hit_rate: float     # per distinct (layer, expert) of each pass
    cpu_share: float           # token-weighted share computed on the host
    fetch_share: float         # token-weighted share copied inside the pass
    collision_misses: int
    prefetch_bytes: float
    fetch_bytes: float
    draft_s: float
    stall_s: float             # time the pass waited for plan copies (wait_for_prefetch)
    vram_needed_GB: float
    fits_vram: bool
    step_time: np.ndarray = field(repr=False)
    config: dict = field(default_factory=dict, repr=False)
    host_slots: int | None = None  # the host tier's experts (None: every expert in RAM)
    disk_bytes: float = 0.0        # read from the disk
    disk_stalls: int = 0           # experts a pass waited for that no read ahead had named (mmap: faulted in)
    disk_wait_s: float = 0.0       # time layers waited for the disk

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else float("nan")

    @property
    def bytes_moved(self) -> float:
        return self.prefetch_bytes + self.fetch_bytes

    def row(self) -> dict:
        return {
            "policy": self.policy, "tok/s": self.tokens_per_s, "hit": self.hit_rate,
            "uniq hit": self.unique_hit_rate, "host": self.cpu_share, "fetched": self.fetch_share,
            "collisions": self.collision_misses, "GB moved": self.bytes_moved / 1e9,
            "ms/step": 1e3 * self.time_s / max(self.n_steps, 1), "fits": self.fits_vram,
            **({} if self.host_slots is None else {"GB read": self.disk_bytes / 1e9, "stalls": self.disk_stalls,
                                                     "disk wait s": self.disk_wait_s})}


class Pool:
    """The expert pool as the simulator sees it: claimed slots and copy completion times."""

    def __init__(self, n_layer: int, n_expert: int, capacity: int, costs: CostModel) -> None:
        self.capacity = capacity
        self.costs = costs
        self.allocated = np.zeros((n_layer, n_expert), dtype=bool)
        self.ready_at = np.full((n_layer, n_expert), np.inf)
        self.started_at = np.full((n_layer, n_expert), np.inf)  # when its copy takes the link
        self.link_free_at = 0.0
        self.link_slowdown = 1.0  # > 1 while copies get only the idle time of a device's one thread
        # when the next pass starts: it freezes every resident slot until it ends (the engine's
        # maps name them), so a copy that must evict starts only before then
        self.frozen_from = np.inf
        self.n_allocated = 0
        self.prefetch_bytes = 0.0
        self.fetch_bytes = 0.0
        self.tier: RankedTier | PageCache | None = None  # the host tier the copies read from (None: every expert in RAM)

    @property
    def holds_all(self) -> bool:
        """A slot for every expert: spac's engine computes on the device alone (patch 0026)."""
        return self.capacity >= self.allocated.size

    def visible(self, at: float) -> np.ndarray:
        return self.allocated & (self.ready_at <= at)

    def copy(self, layer: int, expert: int, earliest: float, in_pass: bool, free: bool = False,
             batch_s: float = 0.0) -> float:
        """Claim a slot and queue the copy on the link; returns its completion time. A copy inside a
        pass goes the staging path (CostModel.fetch_s), after batch_s if it opens its layer's batch."""
        assert not self.allocated[layer, expert] and self.n_allocated < self.capacity
        if self.tier is not None and not free:  # the copy reads the expert from host memory
            earliest = self.tier.source(layer, expert, earliest)
        if free:
            done = earliest
        else:
            self.started_at[layer, expert] = max(earliest, self.link_free_at)
            # a copy inside a pass (the staging path) has the device's thread to itself (the pass
            # waits for it); only a plan's copies share it with passes (link_slowdown)
            took = batch_s + self.costs.fetch_s if in_pass else self.costs.transfer_s * self.link_slowdown
            done = self.started_at[layer, expert] + took
            self.link_free_at = done
            if in_pass:
                self.fetch_bytes += self.costs.expert_bytes
            else:
                self.prefetch_bytes += self.costs.expert_bytes
        self.allocated[layer, expert] = True
        self.ready_at[layer, expert] = done
        self.n_allocated += 1
        return done

    def evict(self, layer: int, expert: int) -> None:
        assert self.allocated[layer, expert]
        self.allocated[layer, expert] = False
        self.ready_at[layer, expert] = np.inf
        self.started_at[layer, expert] = np.inf
        self.n_allocated -= 1

    def cancel_queued(self, now: float) -> None:
        """A new plan replaces the copy queue (the native worker rebuilds it from the newest plan):
        copies that have not started by `now` are dropped and their slots given back."""
        queued = self.allocated & (self.started_at > now) & np.isfinite(self.started_at)
        if not queued.any():
            return
        for layer, expert in np.argwhere(queued):
            self.evict(int(layer), int(expert))
        self.prefetch_bytes -= int(queued.sum()) * self.costs.expert_bytes
        running = self.allocated & (self.ready_at > now) & np.isfinite(self.ready_at)
        self.link_free_at = max(now, float(self.ready_at[running].max()) if running.any() else now)

    def apply(self, plan: Plan, now: float, free: bool = False, evicts: bool = True) -> None:
        """Apply a plan the way the native copy engine does (llama-expert-pool.cpp, set_plan and
        pick_slot): serve the prefetch queue in order; each request takes a free slot, else the
        resident expert first in (position in plan.evict, wanted, utility, layer, expert) order,
        but an expert the plan still wants and did not list goes only for a request of higher
        utility; a request that gets no slot is skipped. evicts=False: the engine's no_evict.
        Copies of an earlier plan that have not started yet are dropped first, as the engine's
        worker rebuilds its queue from the newest plan."""
        if not free:
            self.cancel_queued(now)
        wanted = plan.wanted()
        utility = plan.utility.astype(np.int64)
        prefetch = plan.prefetch if plan.prefetch is not None else order_rows(-utility, wanted & ~self.allocated)
        listed = np.full(wanted.shape, len(plan.evict) if plan.evict is not None else 0, dtype=np.int64)
        if plan.evict is not None and len(plan.evict):
            listed[plan.evict[:, 0], plan.evict[:, 1]] = np.arange(len(plan.evict))
        is_listed = listed < (len(plan.evict) if plan.evict is not None else 0)
        order = np.lexsort((utility.ravel(), wanted.ravel(), listed.ravel()))  # victims first
        n_expert = wanted.shape[1]
        pos = 0
        for layer, expert in prefetch:
            if self.allocated[layer, expert]:
                continue
            if self.n_allocated >= self.capacity:
                if not evicts:
                    continue
                while pos < len(order) and not self.allocated.ravel()[order[pos]]:
                    pos += 1
                if pos == len(order):
                    continue
                victim = divmod(int(order[pos]), n_expert)
                if not is_listed[victim] and wanted[victim] and utility[victim] >= utility[layer, expert]:
                    continue  # everything resident is at least as useful as this request
                if not free and max(now, self.link_free_at) > self.frozen_from:
                    continue  # the sequential worker reaches it while a pass holds every resident slot
                self.evict(*victim)
            self.copy(layer, expert, now, in_pass=False, free=free)


class Simulator:
    def __init__(self, trace: Trace, config: SimConfig = SimConfig(), costs: CostModel | None = None) -> None:
        self.trace = trace
        self.config = config
        self.costs = costs if costs is not None else config.costs()
        n_slots = trace.n_layer * trace.n_expert
        self.capacity = config.capacity if config.capacity is not None else int(round(config.cache_ratio * n_slots))
        if not 0 <= self.capacity <= n_slots:
            raise ValueError(f"capacity {self.capacity} outside [0, {n_slots}]")
        if config.visibility not in ("pass", "layer"):
            raise ValueError(f"visibility must be 'pass' or 'layer', got {config.visibility!r}")
        if config.read_ahead not in ("ranked", "none", "next-pass"):
            raise ValueError(f"read_ahead must be 'ranked', 'none' or 'next-pass', got {config.read_ahead!r}")
        if config.host_rank not in ("uses", "utility"):
            raise ValueError(f"host_rank must be 'uses' or 'utility', got {config.host_rank!r}")
        # the host tier's experts; None: every expert fits in the host RAM (no disk)
        self.host_slots = None
        if config.host_ram is not None:
            slots = host_slots(config.host_ram, self.costs.static_bytes, self.costs.expert_bytes, n_slots)
            self.host_slots = slots if slots < n_slots else None

    def context(self, policy: Policy) -> PolicyContext:
        t = self.trace
        gamma = int(t.n_drafted.max()) if t.n_steps else 0
        future = list(t.steps()) if policy.needs_future else None
        return PolicyContext(t.n_layer, t.n_expert, t.top_k, self.capacity, gamma, future)

    def warmup_feedback(self, pool: Pool) -> Feedback:
        """What a warm-up calibration would measure before the first step: every expert on the host."""
        c, t = self.costs, self.trace
        tokens = (int(t.n_drafted.max()) if t.n_steps else 0) + 1
        layer = c.dense_layer_time(tokens) + tokens * t.top_k * float(c.cpu_expert_s(1))
        return Feedback(
            t_cpu_unit=float(c.cpu_expert_s(1)), t_gpu_unit=float(c.gpu_expert_s(tokens)),
            t_io_unit=c.transfer_s, t_draft_token=c.draft_token_s,
            t_layer=np.full(t.n_layer, layer), expert_bytes=c.expert_bytes,
            free_slots=pool.capacity - pool.n_allocated, copies_block_device=c.copy_blocks_device,
        )

    def run(self, policy: Policy, n_steps: int | None = None) -> SimResult:
        trace, c, cfg = self.trace, self.costs, self.config
        if policy.miss not in ("cpu", "fetch", "greedy"):
            raise ValueError(f"{policy.name}: unknown miss mode {policy.miss!r}")
        if policy.uses_draft_routing and not trace.has_draft_routing and not policy.draft_optional:
            raise ValueError(f"{policy.name} needs the draft's routing; the trace has none (dense draft?)")
        n_steps = trace.n_steps if n_steps is None else min(n_steps, trace.n_steps)
        n_layer, n_expert = trace.n_layer, trace.n_expert
        policy.reset(self.context(policy))
        pool = Pool(n_layer, n_expert, self.capacity, c)
        first = policy.plan(None, pool.allocated.copy(), self.warmup_feedback(pool))
        pool.apply(first, now=0.0, free=True, evicts=policy.evicts)
        if c.sync_every_layer and pool.holds_all:  # spac's engine fills a pool of every expert at load (0026)
            for layer, expert in np.argwhere(~pool.allocated):
                pool.copy(int(layer), int(expert), 0.0, in_pass=False, free=True)
        tier = self._host_tier(policy, pool)
        ranked = isinstance(tier, RankedTier)
        if ranked and cfg.read_ahead == "next-pass":  # the oracle knows the first pass too
            tier.after_pass(np.zeros((n_layer, n_expert)), 0.0, self._utility(policy), self._oracle(0))

        acc = dict(hits=0, unique_hits=0, cpu=0, fetched=0, needed=0, unique_needed=0, collisions=0)
        step_time = np.zeros(n_steps)
        draft_total = stall_total = untimed = 0.0
        now = 0.0
        warm_up = min(cfg.warm_up_steps, n_steps)
        counted = _Counters(pool, tier)
        for s in range(n_steps):
            if s == warm_up and s:  # the warm-up is over: its copies land, then timing starts
                now = untimed = max(now, pool.link_free_at)
                acc = dict.fromkeys(acc, 0)
                draft_total = stall_total = 0.0
                counted = _Counters(pool, tier)
            prompt = trace.prompt_step(s)
            if prompt is not None:  # a new prompt's prefill: it fills the pool, its time is not decode's
                end = self._prompt_pass(policy, pool, tier, prompt, now, acc, s)
                untimed += end - now
                now = end
            routing = trace.step(s)
            start = now
            draft_s = c.draft_time(routing.n_drafted)
            pool.frozen_from = start + draft_s
            lookahead = ranked and cfg.read_ahead == "ranked"  # the tier reads the draft's choices
            if (policy.uses_draft_routing or lookahead) and trace.has_draft_routing and routing.n_drafted:
                drafted = trace.draft_step(s)
                for j in range(routing.n_drafted):
                    at = start + c.draft_time(j + 1)
                    if lookahead:
                        chose = np.zeros((n_layer, n_expert), dtype=bool)
                        rows, cols = np.nonzero(drafted[j] >= 0)
                        chose[rows, drafted[j][rows, cols]] = True
                        tier.lookahead(chose, at, self._utility(policy))
                    if not policy.uses_draft_routing:
                        continue
                    p = policy.draft_plan(drafted[: j + 1], pool.allocated.copy())
                    if p is not None:
                        pool.apply(p, now=at, evicts=policy.evicts)
            verify_start = start + draft_s
            if policy.wait_for_prefetch and pool.link_free_at > verify_start:
                stall_total += pool.link_free_at - verify_start
                verify_start = pool.link_free_at
            # a device whose copies run on its compute thread interleaves them with the pass's
            # work: they fill its idle time, and a new plan drops what has not started, so a pass
            # waits at most for the copy in flight when its device work needs the thread
            backlog = min(max(pool.link_free_at - verify_start, 0.0), c.transfer_s)
            now, layer_time, stats = self._verify(policy, pool, routing, verify_start, acc)
            if c.copy_blocks_device and verify_start + stats["device_busy"] + backlog > now:
                stall_total += verify_start + stats["device_busy"] + backlog - now
                now = verify_start + stats["device_busy"] + backlog
            if c.copy_blocks_device:
                # the next copies run in the device's idle time: without drafting in between (γ = 0)
                # that is the share of a pass the device is idle
                length = now - verify_start
                idle = max(length - stats["device_busy"], 0.05 * length)
                pool.link_slowdown = length / idle if routing.n_drafted == 0 else 1.0
            draft_total += draft_s
            step_time[s] = now - start
            feedback = Feedback(
                t_cpu_unit=stats["cpu_s"] / stats["cpu_tokens"] if stats["cpu_tokens"] else float("nan"),
                t_gpu_unit=stats["gpu_s"] / stats["gpu_experts"] if stats["gpu_experts"] else float("nan"),
                t_io_unit=c.transfer_s, t_draft_token=c.draft_token_s, t_layer=layer_time,
                expert_bytes=c.expert_bytes, free_slots=pool.capacity - pool.n_allocated,
                n_drafted=routing.n_drafted, copies_block_device=c.copy_blocks_device,
            )
            # the next pass starts once the next draft has drafted
            pool.frozen_from = now + (c.draft_time(int(trace.n_drafted[s + 1])) if s + 1 < n_steps else np.inf)
            plan = policy.plan(routing, pool.allocated.copy(), feedback)
            if ranked:  # as live: the tier ranks after the pass, before the plan's copies
                tier.after_pass(routing.frequency(n_expert), now, self._utility(policy), self._oracle(s + 1))
            pool.apply(plan, now=now, evicts=policy.evicts)

        if warm_up == n_steps:  # nothing after the warm-up: nothing timed
            untimed = now
        tokens = int(trace.n_accepted[warm_up:n_steps].sum()) + n_steps - warm_up
        vram = c.static_bytes + self.capacity * c.expert_bytes
        moved = counted.since(pool, tier)
        disk = {} if tier is None else dict(host_slots=tier.slots, disk_bytes=moved["bytes_read"],
                                            disk_stalls=moved["stalls"], disk_wait_s=moved["wait_s"])
        return SimResult(
            policy=policy.name, capacity=self.capacity, n_steps=n_steps - warm_up, tokens=tokens, time_s=now - untimed,
            hit_rate=_ratio(acc["hits"], acc["needed"]), unique_hit_rate=_ratio(acc["unique_hits"], acc["unique_needed"]),
            cpu_share=_ratio(acc["cpu"], acc["needed"]), fetch_share=_ratio(acc["fetched"], acc["needed"]),
            collision_misses=acc["collisions"], prefetch_bytes=moved["prefetch_bytes"], fetch_bytes=moved["fetch_bytes"],
            draft_s=draft_total, stall_s=stall_total, vram_needed_GB=vram / 1e9, fits_vram=vram <= c.vram_bytes,
            step_time=step_time[warm_up:], config=asdict(self.config), **disk,
        )

    def _prompt_pass(self, policy: Policy, pool: Pool, tier, routing: StepRouting, start: float, acc: dict,
                     step: int) -> float:
        """A prompt pass before a step, as live: a policy that copies inside the passes sees it (the
        engine's cache, spac's miss rule), the others are not shown it (the session plans after
        verify passes only), and the host tier ranks after it. Not counted in the hit rates.
        Returns its end; `step` is the step after it."""
        end, _, _ = self._verify(policy, pool, routing, start, dict.fromkeys(acc, 0), observe=policy.miss != "cpu")
        if isinstance(tier, RankedTier):
            tier.after_pass(routing.frequency(self.trace.n_expert), end, self._utility(policy), self._oracle(step))
        return end

    def _host_tier(self, policy: Policy, pool: Pool) -> RankedTier | PageCache | None:
        """The host tier when the experts do not all fit in host RAM: spac's for policies that rank
        every expert (spac's engine runs them), else llama.cpp's page cache; filled before decoding."""
        if self.host_slots is None:
            return None
        t, c, cfg = self.trace, self.costs, self.config
        disk = c.disk or profiles.disk(profiles.DEFAULT_DISK)
        if getattr(policy, "utility", None) is not None:
            tier = RankedTier(t.n_layer, t.n_expert, self.host_slots, disk, c.expert_bytes, pool.allocated, t.top_k,
                              cfg.host_rank, cfg.host_exclusive, read_ahead=cfg.read_ahead != "none")
        else:
            tier = PageCache(t.n_layer, t.n_expert, self.host_slots, disk, c.expert_bytes, cfg.fault_threads)
        tier.fill(pool.allocated)
        pool.tier = tier
        return tier

    def _utility(self, policy: Policy):
        """The policy's scores, for a tier ranked by them (the ablation)."""
        return policy.utility if self.config.host_rank == "utility" else None

    def _oracle(self, step: int) -> np.ndarray | None:
        """read_ahead "next-pass": the experts the next pass will use (None: the live rule)."""
        if self.config.read_ahead != "next-pass":
            return None
        if step >= self.trace.n_steps:
            return np.zeros((self.trace.n_layer, self.trace.n_expert), dtype=bool)
        return self.trace.step(step).frequency(self.trace.n_expert) > 0

    def _verify(self, policy: Policy, pool: Pool, routing: StepRouting, start: float, acc: dict, observe: bool = True):
        """One verify pass from `start`; returns (end time, [n_layer] layer times, unit-cost samples).
        observe: the policy sees the pass's layers (on_layer)."""
        c = self.costs
        counts, weights = layer_usage(routing, self.trace.n_expert)
        n_layer = counts.shape[0]
        layer_time = np.zeros(n_layer)
        stats = dict(cpu_s=0.0, cpu_tokens=0, gpu_s=0.0, gpu_experts=0, device_busy=0.0)
        at_start = pool.allocated.copy()
        evicted = np.zeros_like(pool.allocated)  # evicted by an in-pass copy
        n_tokens = routing.n_drafted + 1
        position = routing.position or 0  # a trace without positions: attention over no cache
        t = start + c.fixed_pass_time(n_tokens, position)
        dense_on_device = not c.sync_on_device  # where the non-expert part runs (measured profiles)
        if dense_on_device:
            stats["device_busy"] += (c.fixed_pass_time(n_tokens, position)
                                     + n_layer * c.dense_layer_time(n_tokens, position))
        cached = self._cached(policy, pool, n_tokens)  # a readback cache serves this pass (or no such cache)
        # a pool of every expert: spac's engine computes on the device alone (patch 0026), with no
        # crossing and no gate in any layer (a miss of another policy's pool still crosses)
        holds_all = pool.holds_all
        for layer in range(n_layer):
            t_layer = t
            t += c.dense_layer_time(n_tokens, position)
            n = counts[layer]
            need = n > 0
            if cached and observe:  # the router has run: the layer's experts are in use
                policy.on_layer(layer, n, weights[layer])
            seen_at = start if self.config.visibility == "pass" else t
            hit = need & at_start[layer] & pool.allocated[layer] & (pool.ready_at[layer] <= seen_at) & cached
            miss = need & ~hit
            acc["needed"] += int(n.sum())
            acc["unique_needed"] += int(need.sum())
            acc["hits"] += int(n[hit].sum())
            acc["unique_hits"] += int(hit.sum())
            acc["collisions"] += int((miss & evicted[layer]).sum())
            device = float(c.gpu_expert_s(n[hit]).sum())
            stats["gpu_s"] += device
            stats["gpu_experts"] += int(hit.sum())
            host_experts = np.flatnonzero(miss)
            t_miss = t  # when the misses are in host memory: a host tier reads those on the disk first
            if pool.tier is not None:
                t_miss = pool.tier.ready(layer, np.flatnonzero(miss & ~pool.allocated[layer]), t)
            # a gate after the router decides the misses: the device half waits for its choice on the host
            end_device = t + (c.sync_s if policy.gate_readback and not holds_all else 0.0) + device
            if policy.readback_max_tokens is not None and cached:
                # llama-moe-cache: the router's choice read back (a device synchronize, every cached
                # layer), the misses uploaded, then one op computes every routed expert on the device;
                # with a CPU share, once the cache is full, that share of the misses on the host
                ready = max(t + c.sync_s, t_miss)
                host_experts = np.zeros(0, dtype=np.int64)
                if policy.cpu_share and pool.n_allocated >= pool.capacity:
                    host_experts = policy.host_misses(layer, np.flatnonzero(miss), n)
                upload = miss.copy()
                upload[host_experts] = False
                arrived = _InPassFetcher(self, policy, pool, layer, upload, t_miss, evicted).upload(ready)
                end_device = max(ready, arrived) + device + float(c.gpu_expert_s(n[upload]).sum())
            elif policy.miss != "cpu" and cached and miss.any():
                fetcher = _InPassFetcher(self, policy, pool, layer, miss, t_miss, evicted)
                if policy.miss == "fetch":
                    host_experts = np.zeros(0, dtype=np.int64)
                    for e in np.flatnonzero(miss):
                        end_device = fetcher.fetch(e, end_device, n[e])
                else:
                    host_experts, end_device = fetcher.greedy(n, end_device)
                    if policy.gate_readback:
                        # the engine's gate, a host op ahead of both halves, returns once its
                        # uploads have landed (native miss_gate): the host half starts after them,
                        # the device half too, with the layer's resident and uploaded experts
                        gate_end = max(t + c.sync_s, fetcher.landed)
                        uploaded = np.setdiff1d(np.flatnonzero(miss), host_experts)
                        end_device = gate_end + device + float(c.gpu_expert_s(n[uploaded]).sum())
                        t_miss = max(t_miss, fetcher.landed)
            host = float(c.cpu_expert_s(n[host_experts]).sum())
            n_host = int(n[host_experts].sum())
            if c.zero_slot and n_host:  # the device multiplies the absent experts' tokens by zero slots
                end_device += c.zero_slots_s(n_host, self.trace.top_k)
            stats["device_busy"] += end_device - t
            stats["cpu_s"] += host
            stats["cpu_tokens"] += n_host
            acc["cpu"] += n_host
            acc["fetched"] += int(n[miss].sum() - n_host)
            split = len(host_experts) or (c.sync_every_layer and not holds_all)
            sync = c.sync_s + n_tokens * c.sync_token_s if split else 0.0
            serial = min(c.sync_serial_s, sync)  # both halves wait for it
            end_host = t_miss + host + (0.0 if c.sync_on_device else sync)
            end_device += serial + (sync - serial if c.sync_on_device else 0.0)
            t = max(end_device, end_host) if c.overlap else end_device + (end_host - t)
            layer_time[layer] = t - t_layer
        return t, layer_time, stats

    def _cached(self, policy: Policy, pool: Pool, n_tokens: int) -> bool:
        """Whether a readback cache (llama-moe-cache) serves a pass of n_tokens: at most its token
        limit, and no more distinct experts than its slots (those of the layer, per layer)."""
        limit = policy.readback_max_tokens
        if limit is None:
            return True
        slots = policy.per_layer_capacity or pool.capacity
        return n_tokens <= limit and min(n_tokens * self.trace.top_k, self.trace.n_expert) <= slots


class _Counters:
    """The pool's and the tier's running byte and stall counts at one moment (the end of a warm-up)."""

    POOL = ("prefetch_bytes", "fetch_bytes")
    TIER = ("bytes_read", "stalls", "wait_s")

    def __init__(self, pool: Pool, tier) -> None:
        self.at = {k: getattr(pool, k) for k in self.POOL}
        self.at.update({k: getattr(tier, k) for k in self.TIER} if tier is not None else {})

    def since(self, pool: Pool, tier) -> dict:
        now = _Counters(pool, tier).at
        return {k: now[k] - self.at[k] for k in now}


class _InPassFetcher:
    """On-demand copies of one layer's missing experts ("fetch" and "greedy" modes).

    The layer's resident experts are computed first; each missing expert is protected from
    eviction until it has been computed. Victims come from the policy, one per copy.
    """

    def __init__(self, sim: Simulator, policy: Policy, pool: Pool, layer: int, miss: np.ndarray,
                 t: float, evicted: np.ndarray) -> None:
        self.costs, self.policy, self.pool, self.layer, self.t = sim.costs, policy, pool, layer, t
        self.evicted = evicted
        self.protected = np.zeros_like(pool.allocated)
        self.protected[layer] = miss
        self.landed = t  # when the last of the layer's copies arrives
        self.batch_s = sim.costs.stage_batch_s  # the layer's first copy opens its staging batch

    def _need_slot(self) -> bool:
        cap = self.policy.per_layer_capacity
        if cap is not None and self.pool.allocated[self.layer].sum() >= cap:
            return True
        return self.pool.n_allocated >= self.pool.capacity

    def _evict_one(self) -> None:
        """Ask the policy for one victim at a time: each copy changes what the best victim is."""
        rows = self.policy.victims(self.pool.allocated, self.protected, self.layer, 1)
        victim = (int(rows[0][0]), int(rows[0][1])) if len(rows) else None
        if victim is None or not self.pool.allocated[victim] or self.protected[victim]:
            # the policy declined although a slot is needed: the first candidate goes
            candidates = self.pool.allocated & ~self.protected
            flat = np.flatnonzero(candidates)
            if not len(flat):
                raise RuntimeError(f"{self.policy.name}: no slot to give to an expert of layer {self.layer}")
            victim = divmod(int(flat[0]), candidates.shape[1])
        self.pool.evict(*victim)
        self.evicted[victim] = True

    def arrival(self, expert: int) -> float:
        """When `expert` would be on the device if copied now (or is, if on its way), by its
        fetch_s alone: the layer's batch cost is charged when it copies (Pool.copy), not counted
        here, as the engine's gate decides on a cost per upload (MissCosts.upload_s)."""
        pool = self.pool
        if pool.allocated[self.layer, expert]:
            return float(pool.ready_at[self.layer, expert])
        return max(self.t, pool.link_free_at) + self.costs.fetch_s

    def _copy_in(self, expert: int, earliest: float) -> float:
        """When `expert` is on the device: its arrival if it is on its way already, else that of a
        copy from `earliest` into the slot of the policy's victim."""
        pool = self.pool
        if pool.allocated[self.layer, expert]:
            arrival = float(pool.ready_at[self.layer, expert])
        else:
            if self._need_slot():
                self._evict_one()
            arrival = pool.copy(self.layer, expert, earliest, in_pass=True, batch_s=self.batch_s)
            self.batch_s = 0.0
        self.landed = max(self.landed, arrival)
        return arrival

    def fetch(self, expert: int, device_free: float, n_tokens: int) -> float:
        """Copy (if needed) and compute `expert`; returns when the device is free again."""
        arrival = self._copy_in(expert, self.t)
        self.protected[self.layer, expert] = False
        return max(device_free, arrival) + float(self.costs.gpu_expert_s(n_tokens))

    def upload(self, earliest: float) -> float:
        """Upload every missing expert of the layer from `earliest`, in ascending ids (all of them
        protected until the last has landed: the layer computes them together); returns when the
        last one has arrived."""
        arrived = earliest
        for expert in np.flatnonzero(self.protected[self.layer]):
            arrived = max(arrived, self._copy_in(expert, earliest))
        self.protected[self.layer] = False
        return arrived

    def greedy(self, n: np.ndarray, device_free: float):
        """HybriMoE's two-ended greedy: missing experts sorted by token count; the device takes
        the hottest (after its copy), the host the coldest, whichever would finish first. A
        policy's upload credit (`Policy.upload_credit`) counts for the upload: spac's miss rule."""
        c = self.costs
        order = np.flatnonzero(self.protected[self.layer])
        credit = self.policy.upload_credit(self.layer, order, c)
        # hottest first, an upload's credit counted as the tokens of host time it saves
        per_token = max(float(c.cpu_expert_s(1)), 1e-12)
        rank = np.argsort(-(n[order] + credit / per_token), kind="stable")
        order, credit = order[rank], credit[rank]
        lo, hi = 0, len(order) - 1
        host_free = self.t
        host = []
        while lo <= hi:
            hot, cold = order[lo], order[hi]
            device_done = max(device_free, self.arrival(hot)) + float(c.gpu_expert_s(n[hot]))
            host_done = host_free + float(c.cpu_expert_s(n[cold]))
            if device_done <= host_done + credit[lo]:
                device_free = self.fetch(hot, device_free, n[hot])
                lo += 1
            else:
                host.append(cold)
                self.protected[self.layer, cold] = False
                host_free = host_done
                hi -= 1
        return np.array(host, dtype=np.int64), device_free


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")
