"""The policy interface shared by the live engine and the simulator.

A policy is a decision, not an execution (vLLM v1's scheduler/worker split): after each
verification step it turns the routing of that step, plus its own state, into a `Plan`
(`orchestrator.policies.plan`): which experts it wants on the device, in which order to copy them,
in which order to give slots back. Whoever executes plans (the native copy engine, or
`orchestrator.sim.simulator`) applies it the same way:

    wanted    = plan.wanted()                       utility ≥ threshold[layer]
    prefetch  = plan.prefetch, or wanted experts not on the device by utility (high first),
                then layer, then expert id; served in order, each taking a free slot or
                evicting, and skipped when no slot may be had
    evict     = only when a prefetch needs a slot: the resident expert first in (position in
                plan.evict, not wanted before wanted, utility, layer, expert) order; an
                expert that is wanted and not listed goes only for a request of higher
                utility. A policy with `evicts = False` never evicts (the engine's no_evict).

Calls, per verification step (the live loop and the simulator make the same ones):

    on_layer(layer, counts, weights)   once per MoE layer in pass order: what the layer used
    plan(routing, resident, feedback)  after the pass: the plan for the next step
    draft_plan(draft_selected, ...)    policies with `uses_draft_routing`: after each draft
                                       token, a plan that may add prefetches (MoE-SpeQ)

`miss` says how a needed expert that is not on the device is served. The native engine
always computes it on the host ("cpu"); the simulator also models the GPU-centric systems of
the baselines: "fetch" (copy it on demand and compute on the device, Mixtral-offloading) and
"greedy" (HybriMoE's two-ended split between the two). Those modes evict inside a pass, by
asking `victim`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from orchestrator.policies.plan import Plan, StepRouting

MISS_MODES = ("cpu", "fetch", "greedy")


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know about the setting it runs in.

    capacity: expert-pool slots over all MoE layers. gamma: nominal draft length.
    future: the routing of all steps of the run, for the oracle only (None in a live run).
    devices: a pool over several devices, (first MoE layer, end, slots) of each: a device's slots
    hold only its own layers' experts, and each copies over its own link; () = one device.
    """

    n_layer: int
    n_expert: int
    top_k: int
    capacity: int
    gamma: int = 8
    future: Sequence[StepRouting] | None = None
    devices: tuple[tuple[int, int, int], ...] = ()

    def device_spans(self) -> tuple[tuple[int, int, int], ...]:
        """(first MoE layer, end, slots) of every pool device (one over all layers by default)."""
        return self.devices or ((0, self.n_layer, self.capacity),)


@dataclass
class Feedback:
    """Measurements of the last verification step, reported by whoever executes plans.

    Times in seconds; NaN where the step gave no sample (e.g. nothing ran on the host).
    t_cpu_unit: host time per (token, expert); t_gpu_unit: device time per distinct expert;
    t_io_unit: copy time per expert; t_layer: [n_layer] time of each MoE layer in the pass.
    copies_block_device: the pool device receives copies on the thread that computes (an RPC
    server, the CPU test device), so a copy still running when the pass starts delays it; a GPU
    copies on its own engine while it computes.
    """

    t_cpu_unit: float
    t_gpu_unit: float
    t_io_unit: float
    t_draft_token: float
    t_layer: np.ndarray
    expert_bytes: float
    free_slots: int
    n_drafted: int = 0
    copies_block_device: bool = True
    # several pool devices (PolicyContext.devices), each one's: free slots, copy time per expert
    # (NaN: no copy this step) and whether its copies delay its passes (() = the fields above)
    free_slots_per_device: tuple[int, ...] = ()
    t_io_per_device: tuple[float, ...] = ()
    copies_block_per_device: tuple[bool, ...] = ()
    extra: dict = field(default_factory=dict)


class Policy:
    """Base class; subclasses override `plan` and, as needed, the other hooks."""

    name = "policy"
    miss = "cpu"
    uses_draft_routing = False
    draft_optional = False  # with uses_draft_routing: also runs (without draft_plan calls) when there is none
    needs_future = False
    evicts = True
    wait_for_prefetch = False  # the simulator starts the pass only once the plan's copies are done
    # a demand cache that reads the router's choice back before it uploads a layer's misses (a device
    # synchronize), then computes all the layer's experts on the device in one op, for passes of at
    # most this many tokens (more: the layer runs on the host, the cache untouched); None: no readback
    readback_max_tokens: int | None = None
    cpu_share = 0.0  # such a cache, once full: the share of a layer's misses computed on the host
    # miss "greedy" decided in a gate after the layer's router (spac's miss rule, issue 51): the
    # device half waits for the router's choice on the host (a synchronize) and the gate's uploads
    gate_readback = False

    def upload_credit(self, layer: int, experts: np.ndarray, costs) -> np.ndarray:
        """Seconds of host time that uploading each of `experts` (misses of `layer`) is expected to
        save in its later uses: the "greedy" miss rule uploads an expert when its copy and device
        compute finish no later than the host would plus this credit. 0: this pass only (HybriMoE)."""
        return np.zeros(len(experts))

    def reset(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    def on_layer(self, layer: int, counts: np.ndarray, weights: np.ndarray) -> None:
        """Layer `layer` of the pass used counts[e] tokens of expert e (routing weight sums)."""

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        """The plan for the next step. routing is None before the first step (initial placement).
        Its arrays may be views of the executor's buffers: valid during the call, copy to keep."""
        raise NotImplementedError

    def draft_plan(self, draft_selected: np.ndarray, resident: np.ndarray) -> Plan | None:
        """After each draft token: the draft's routing so far [n, n_layer, top_k]; None: no change."""
        return None

    def victims(self, allocated: np.ndarray, protected: np.ndarray, layer: int, n: int) -> np.ndarray:
        """In-pass eviction ("fetch"/"greedy" modes): an expert of `layer` is about to be copied
        and needs a slot. Return up to n (layer, expert) rows, first victim first, among
        `allocated & ~protected` (protected: what the current layer has yet to compute); with
        `per_layer_capacity` set, from `layer`'s own experts only. The arrays are the
        executor's: read them, do not keep or modify them."""
        return smallest_rows(np.zeros(allocated.shape), self._victim_scope(allocated, protected, layer), n)

    per_layer_capacity: int | None = None  # evict within the layer once it holds this many

    def _victim_scope(self, allocated: np.ndarray, protected: np.ndarray, layer: int) -> np.ndarray:
        scope = allocated & ~protected
        if self.per_layer_capacity is not None:
            row = scope[layer].copy()
            scope = np.zeros_like(scope)
            scope[layer] = row
        return scope


def observe(policy: Policy, routing: StepRouting, n_expert: int) -> None:
    """Feed a whole pass to `on_layer` in layer order (what the live loop does after a verify)."""
    counts, weights = layer_usage(routing, n_expert)
    for layer in range(counts.shape[0]):
        policy.on_layer(layer, counts[layer], weights[layer])


def layer_usage(routing: StepRouting, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts int [n_layer, n_expert], routing-weight sums float [n_layer, n_expert])."""
    counts = routing.frequency(n_expert)
    if routing.weights is None:
        return counts, counts.astype(np.float64)
    n_tokens, n_layer, top_k = routing.selected.shape
    layer = np.broadcast_to(np.arange(n_layer)[None, :, None], routing.selected.shape)
    valid = routing.selected >= 0  # -1: a row the layer did not compute
    weights = np.zeros((n_layer, n_expert))
    np.add.at(weights, (layer[valid], routing.selected[valid]), routing.weights.astype(np.float64)[valid])
    return counts, weights


def keep_plan(wanted: np.ndarray, prefetch: np.ndarray | None = None, evict: np.ndarray | None = None) -> Plan:
    """A plan wanting exactly `wanted` (bool [n_layer, n_expert]): utility 1, threshold 1."""
    return Plan(utility=wanted.astype(np.uint8), threshold=np.ones(wanted.shape[0], dtype=np.int32),
                prefetch=prefetch, evict=evict)


def ranked_plan(score: np.ndarray, capacity: int, resident: np.ndarray, per_layer: bool = False) -> Plan:
    """Want the `capacity` highest finite scores (per layer: capacity // n_layer each).

    Prefetch order: score high → low; eviction order: score low → high, ties in both lists by
    (layer, expert); on ties the higher (layer, expert) is the one wanted.
    """
    wanted = top_scores(score, capacity, per_layer)
    prefetch = order_rows(-score, wanted & ~resident)
    evict = order_rows(score, resident & ~wanted)
    return keep_plan(wanted, prefetch, evict)


def top_scores(score: np.ndarray, capacity: int, per_layer: bool = False) -> np.ndarray:
    """bool mask of the highest finite scores: `capacity` overall, or capacity // n_layer per layer."""
    n_layer, n_expert = score.shape
    wanted = np.zeros(score.shape, dtype=bool)
    if per_layer:
        k = min(capacity // n_layer, n_expert)
        for layer in range(n_layer):
            wanted[layer, _top(score[layer], k)] = True
    else:
        wanted.ravel()[_top(score.ravel(), min(capacity, score.size))] = True
    return wanted


def top_per_device(score: np.ndarray, ctx: PolicyContext, per_layer: bool = False) -> np.ndarray:
    """top_scores within each pool device's layers, as many as its slots (PolicyContext.devices):
    a device's slots can hold only its own layers' experts."""
    wanted = np.zeros(score.shape, dtype=bool)
    for first, end, slots in ctx.device_spans():
        wanted[first:end] = top_scores(score[first:end], slots, per_layer)
    return wanted


def order_rows(key: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int32 [n, 2] (layer, expert) rows of `mask`, by key ascending, ties by flat index."""
    flat = np.flatnonzero(mask)
    flat = flat[np.argsort(key.ravel()[flat], kind="stable")]
    return np.stack(np.unravel_index(flat, mask.shape), axis=1).astype(np.int32)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest finite values; ties keep the higher index (victims take the lower)."""
    finite = np.flatnonzero(np.isfinite(values))
    order = finite[np.lexsort((-finite, -values[finite]))]
    return order[:k]


def smallest_rows(key: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """The n (layer, expert) rows of `mask` with the smallest key, in order, ties by flat index."""
    if n == 1 and mask.any():  # the common in-pass query, without sorting
        flat = int(np.argmin(np.where(mask, key, np.inf)))
        if not mask.ravel()[flat]:  # every candidate's key is +inf
            flat = int(np.flatnonzero(mask)[0])
        return np.array([divmod(flat, mask.shape[1])], dtype=np.int32)
    flat = np.flatnonzero(mask)
    k = key.ravel()[flat]
    if n < len(flat):
        cut = np.partition(k, n - 1)[n - 1] if n > 0 else -np.inf
        below, at = flat[k < cut], flat[k == cut]
        flat = np.sort(np.concatenate([below, at[: n - len(below)]]))
        k = key.ravel()[flat]
    flat = flat[np.argsort(k, kind="stable")]
    return np.stack(np.unravel_index(flat, mask.shape), axis=1).astype(np.int32)
