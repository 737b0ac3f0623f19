"""The host tier: the experts held in host RAM when the model is larger than it; the rest on the disk.

Three tiers, disk → host → device. The host tier has `slots` experts' room: the RAM the run may
use (`SimConfig.host_ram`) less what is always resident (`host_slots`). Which experts it holds
depends on the system:

    RankedTier (spac)   the live tier's rule (orchestrator/runtime/host_tier.py, HostTier): each
                        expert's use count, +1 per token that chose it and × DECAY after every
                        pass. After each verify pass the `slots` best-ranked experts, the pass's
                        own choices first, are kept: those not in memory and chosen lately at least
                        twice as often as uniform routing would are read ahead (queued on the disk,
                        off the critical path), and the others dropped. While a draft with
                        routing drafts (a pool draft), each token's chosen experts count one more,
                        rank first and are read. The tier is exclusive of the device pool: each
                        ranking drops, and does not count, the experts the pool holds. A copy to
                        the device reads the expert from the tier, or else from the disk; an
                        expert the pool evicts is on the disk until a ranking reads it again. A pass needing an expert
                        still on the disk stalls: the layer's gate reads all its missing experts at
                        once (`Disk.read_s`), and they stay until the next ranking.
                        Ablations: rank="utility" (the policy's scores instead of the counts),
                        exclusive=False (the pool's experts kept too, ranked above every other:
                        the earlier design, where the device copies from the host).
    PageCache (llama.cpp's mmap)
                        least recently used first out, no read-ahead; an expert not in it is read
                        by page faults when the threads touch it (`Disk.fault_s`).

The disk is one queue: reads run one after the other at its rate (a stall goes first, and the
reads queued behind it land later by as much). An expert is in the tier from the moment its read
is issued and usable once the read has landed (`arrives_at`).
"""

from __future__ import annotations

import numpy as np

from orchestrator.sim.disk import FAULT_THREADS, Disk

HOST_MARGIN = 1 << 30  # left free in host RAM besides the resident weights and caches (as the device's margin)
# a choice counts this much less after every pass: orchestrator.runtime.host_tier.DECAY (copied,
# not imported: that module loads the native engine's bindings)
DECAY = 0.8
# a read ahead after a pass only for an expert chosen at least this many times as often per pass
# lately (its decayed count × (1 − DECAY)) as uniform routing would (top_k / n_expert); the
# draft's choices whatever their count (the live tier's rule,
# orchestrator.runtime.host_tier.READ_AHEAD_OVER_UNIFORM, copied as DECAY is)
READ_AHEAD_OVER_UNIFORM = 2.0
FIRST = 1e9  # what a pass or the draft needs now outranks any history (the live tier's)
# the experts the tier starts with count as chosen once by a prompt this many passes before the
# first decoded one (an assumption: a trace has no prompt; the live tier ranks the prompt's pass)
PROMPT_AGE = 30


def host_slots(host_ram: float, resident_bytes: float, expert_bytes: float, n_experts: int) -> int:
    """Experts the host tier holds: what `host_ram` leaves after the always-resident bytes (the
    non-expert weights, the draft, the KV caches) and a margin, at most every expert."""
    free = host_ram - resident_bytes - HOST_MARGIN
    return int(min(max(free // expert_bytes, 0), n_experts))


class _Tier:
    """What both tiers share: which experts are in memory, when their reads land, the disk queue
    and the counts."""

    def __init__(self, n_layer: int, n_expert: int, slots: int, disk: Disk, expert_bytes: float) -> None:
        self.n_expert, self.slots, self.disk, self.expert_bytes = n_expert, slots, disk, expert_bytes
        shape = (n_layer, n_expert)
        self.in_host = np.zeros(shape, dtype=bool)
        self.arrives_at = np.full(shape, -np.inf)
        self.disk_free_at = 0.0
        self.bytes_read = 0.0
        self.reads_ahead = 0   # experts read before a pass asked for them
        self.stalls = 0        # experts a pass waited for that no read had named (mmap: faulted in)
        self.wait_s = 0.0      # time layers waited for the disk

    def fill(self, first: np.ndarray) -> None:
        """Before decoding (free, as a prompt would leave it): the experts of `first`, then the
        others in layer order."""
        flat = first.ravel()
        order = np.concatenate([np.flatnonzero(flat), np.flatnonzero(~flat)])[: self.slots]
        self.in_host.ravel()[order] = True

    def ready(self, layer: int, experts: np.ndarray, t: float) -> float:
        """When `experts` of `layer`, needed from host memory by a layer starting at t, are there:
        those on the disk are read now (a stall)."""
        if not len(experts):
            return t
        flat = layer * self.n_expert + np.asarray(experts)
        self._touch(flat, t)
        missing = flat[~self.in_host.ravel()[flat]]
        read = self._read_now(missing, t, flat) if len(missing) else t
        # after the reads: they land the queued ones later
        done = max(float(self.arrives_at.ravel()[flat].max()), read, t)
        self.wait_s += done - t
        return done

    def _read_now(self, flat: np.ndarray, t: float, in_use: np.ndarray) -> float:
        """Read `flat` (on the disk) at t ahead of the queue; returns when they have landed."""
        took = self._stall_s(len(flat))
        if self.disk_free_at > t:  # the queued reads land later by as much
            self.arrives_at[self.arrives_at > t] += took
            self.disk_free_at += took
        else:
            self.disk_free_at = t + took
        self.arrives_at.ravel()[self._enter(flat, t, in_use)] = t + took
        self.bytes_read += len(flat) * self.expert_bytes
        self.stalls += len(flat)
        return t + took

    def _queue(self, n: int, now: float) -> np.ndarray:
        """Arrivals of n reads issued at `now` behind the queued ones, queue_depth in flight."""
        k = np.arange(1, n + 1)
        start = max(now, self.disk_free_at)
        arrival = start + np.ceil(k / max(self.disk.queue_depth, 1)) * self.disk.latency_s \
            + k * self.expert_bytes / self.disk.read_bytes_per_s
        if n:
            self.disk_free_at = float(arrival[-1])
        self.bytes_read += n * self.expert_bytes
        return arrival

    def _touch(self, flat: np.ndarray, t: float) -> None:
        pass

    def _stall_s(self, n: int) -> float:
        raise NotImplementedError

    def _enter(self, flat: np.ndarray, t: float, in_use: np.ndarray) -> np.ndarray:
        """Put `flat` (read now) in the tier; returns those that got in."""
        raise NotImplementedError


class RankedTier(_Tier):
    """spac's tier, ranked and read ahead as the live one (see the module's docstring).

    device: the device pool's holdings (Pool.allocated, updated in place by the pool); rank:
    "uses" (the live tier's counts) or "utility" (the policy's scores, given at each ranking);
    read_ahead=False: the live ablation that only keeps and drops."""

    def __init__(self, n_layer: int, n_expert: int, slots: int, disk: Disk, expert_bytes: float,
                 device: np.ndarray, top_k: int, rank: str = "uses", exclusive: bool = True,
                 read_ahead: bool = True) -> None:
        super().__init__(n_layer, n_expert, slots, disk, expert_bytes)
        if rank not in ("uses", "utility"):
            raise ValueError(f"host tier rank must be 'uses' or 'utility', got {rank!r}")
        self.device, self.rank, self.exclusive, self.read_ahead = device, rank, exclusive, read_ahead
        self.score = np.zeros((n_layer, n_expert))
        self.min_rate = READ_AHEAD_OVER_UNIFORM * top_k / n_expert

    def fill(self, first: np.ndarray) -> None:
        """Exclusive: none of the pool's experts (`first`); inclusive: those first. They and the
        pool's rank as a prompt's choices would (else the first ranking would drop them all)."""
        if self.exclusive:
            self.in_host.ravel()[np.flatnonzero(~first.ravel())[: self.slots]] = True
        else:
            super().fill(first)
        self.score[self.in_host | first] = DECAY ** PROMPT_AGE

    def after_pass(self, counts: np.ndarray, now: float, utility=None, keep: np.ndarray | None = None) -> None:
        """A verify pass has run; counts: [n_layer, n_expert] its tokens per expert. Rank again with
        its choices first (keep: an oracle's set instead), read ahead what ranks in, drop the rest."""
        if self.rank == "uses":
            self.score += counts
            self.score *= DECAY
        else:
            self.score = np.asarray(utility, dtype=np.float64)
        self._settle(counts > 0 if keep is None else keep, now)

    def lookahead(self, chose: np.ndarray, now: float, utility=None) -> None:
        """A draft token's chosen experts ([n_layer, n_expert] bool), which the next pass will likely
        use: counted, ranked first, read now."""
        if self.rank == "uses":
            self.score[chose] += 1.0
        else:
            self.score = np.asarray(utility, dtype=np.float64)
        self._settle(chose, now)

    def _settle(self, keep: np.ndarray, now: float) -> None:
        """Hold the `slots` best-ranked experts (`keep` first) not on the device (exclusive) or the
        device's above all (inclusive): queue the reads of those not in memory, in layer order, and
        drop the others."""
        rank = self.score + keep * FIRST
        if self.exclusive:
            eligible = ~self.device
        else:
            rank = np.where(self.device, 2 * FIRST, rank)
            eligible = np.ones_like(self.device)
        if self.rank == "uses":  # as the live tier: never an expert no pass has chosen
            eligible &= rank > 0
        want = np.zeros(rank.size, dtype=bool)
        want[np.argsort(-np.where(eligible, rank, -np.inf), axis=None, kind="stable")[: self.slots]] = True
        want = want.reshape(rank.shape) & eligible
        drop = self.in_host & ~want
        self.in_host[drop] = False
        self.arrives_at[drop] = -np.inf
        if self.read_ahead:
            read = want & ~self.in_host
            if self.rank == "uses":  # as the live tier: only what is chosen often enough, or now
                read &= keep | (self.score * (1 - DECAY) >= self.min_rate)
            read = np.flatnonzero(read.ravel())
            self.arrives_at.ravel()[read] = self._queue(len(read), now)
            self.in_host.ravel()[read] = True
            self.reads_ahead += len(read)

    def source(self, layer: int, expert: int, t: float) -> float:
        """When a copy to the device, from t, has `expert` in host memory: from the tier (exclusive:
        until the next ranking, as live, which drops it once the pool holds it; a copy cancelled
        before then finds it still there), else read for the copy behind the queued reads (kept,
        inclusive)."""
        flat = layer * self.n_expert + expert
        if self.in_host.ravel()[flat]:
            return max(t, float(self.arrives_at.ravel()[flat]))
        at = float(self._queue(1, t)[0])
        if not self.exclusive:
            self.in_host.ravel()[flat] = True
            self.arrives_at.ravel()[flat] = at
        return at

    def _stall_s(self, n: int) -> float:
        return self.disk.read_s(n, n * self.expert_bytes)  # the gate's reads at once

    def _enter(self, flat: np.ndarray, t: float, in_use: np.ndarray) -> np.ndarray:
        self.in_host.ravel()[flat] = True  # beyond the slots until the next ranking, as the live tier
        return flat


class PageCache(_Tier):
    """llama.cpp's mmap: an LRU of the same RAM, experts faulted in when touched."""

    def __init__(self, n_layer: int, n_expert: int, slots: int, disk: Disk, expert_bytes: float,
                 fault_threads: int = FAULT_THREADS) -> None:
        super().__init__(n_layer, n_expert, slots, disk, expert_bytes)
        self.fault_threads = fault_threads
        self.last_used = np.zeros((n_layer, n_expert))

    def source(self, layer: int, expert: int, t: float) -> float:
        """When an upload to the device, from t, has `expert` in host memory (faulted in if not)."""
        flat = np.array([layer * self.n_expert + expert])
        self._touch(flat, t)
        if not self.in_host.ravel()[flat[0]]:
            return self._read_now(flat, t, flat)
        return max(t, float(self.arrives_at.ravel()[flat[0]]))

    def _touch(self, flat: np.ndarray, t: float) -> None:
        self.last_used.ravel()[flat] = t

    def _stall_s(self, n: int) -> float:
        return self.disk.fault_s(n, self.expert_bytes, self.fault_threads)

    def _enter(self, flat: np.ndarray, t: float, in_use: np.ndarray) -> np.ndarray:
        """Take slots for `flat`, evicting the least recently used experts that have landed and are
        not in use now; those with no slot are read for this use alone."""
        n_in = int(self.in_host.sum())
        candidates = self.in_host & (self.arrives_at <= t)
        candidates.ravel()[in_use] = False
        n = min(len(flat) - (self.slots - n_in), int(candidates.sum()))
        if n > 0:
            key = np.where(candidates, self.last_used, np.inf).ravel()
            victims = np.argpartition(key, n - 1)[:n]
            self.in_host.ravel()[victims] = False
            self.arrives_at.ravel()[victims] = -np.inf
            n_in -= n
        admitted = flat[: max(self.slots - n_in, 0)]
        self.in_host.ravel()[admitted] = True
        return admitted
