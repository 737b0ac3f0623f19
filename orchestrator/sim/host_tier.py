"""The host tier: the experts held in host RAM when the model is larger than it; the rest on the disk.

Three tiers, disk → host → device. The host tier has `slots` experts' room: the RAM the run may
use (`SimConfig.host_ram`) less what is always resident (`host_slots`). Which experts it holds
depends on the system:

    planned (spac)   ranked like the device pool, by the policy's scores (its `utility`), and a
                     superset of the pool (the device copies from the host, so the pool's experts
                     are never its victims). After each verify pass, and after each draft token,
                     the plan's read-ahead names the experts the next pass will need (the last
                     pass's routing, the draft's, the experts the plan wants on the device): they
                     are read then, off the critical path, and kept until that pass has run. A
                     pass that needs an expert still on the disk stalls: the layer's gate reads
                     all its missing experts at once (`Disk.read_s`).
    mmap (llama.cpp) the page cache: least recently used first out, no read-ahead; an expert not
                     in it is read by page faults when the threads touch it (`Disk.fault_s`).

The disk is one queue: reads run one after the other at its rate (a stall goes first, and the
reads queued behind it land later by as much). An expert is in the tier from the moment its read
is issued (its slot is taken) and usable once the read has landed (`arrives_at`). A read with no
slot to land in (every expert of the tier pinned or about to be used) is read for the pass and
dropped.
"""

from __future__ import annotations

import numpy as np

from orchestrator.sim.disk import FAULT_THREADS, Disk

HOST_MARGIN = 1 << 30  # left free in host RAM besides the resident weights and caches (as the device's margin)


def host_slots(host_ram: float, resident_bytes: float, expert_bytes: float, n_experts: int) -> int:
    """Experts the host tier holds: what `host_ram` leaves after the always-resident bytes (the
    non-expert weights, the draft, the KV caches) and a margin, at most every expert."""
    free = host_ram - resident_bytes - HOST_MARGIN
    return int(min(max(free // expert_bytes, 0), n_experts))


class HostTier:
    def __init__(self, n_layer: int, n_expert: int, slots: int, disk: Disk, expert_bytes: float, planned: bool,
                 fault_threads: int = FAULT_THREADS) -> None:
        self.n_expert, self.slots, self.disk, self.expert_bytes = n_expert, slots, disk, expert_bytes
        self.planned, self.fault_threads = planned, fault_threads
        shape = (n_layer, n_expert)
        self.in_host = np.zeros(shape, dtype=bool)
        self.arrives_at = np.full(shape, -np.inf)
        self.last_used = np.zeros(shape)
        self.score = np.zeros(shape)            # planned: the policy's ranking
        self.expected = np.zeros(shape, dtype=bool)  # planned: read ahead for the next pass, kept until it ran
        self.n_in = 0
        self.disk_free_at = 0.0
        self.bytes_read = 0.0
        self.reads_ahead = 0   # experts read before a pass asked for them
        self.stalls = 0        # experts a pass waited for with no read issued before (planned) / faulted in (mmap)
        self.wait_s = 0.0      # time layers waited for the disk

    def fill(self, first: np.ndarray) -> None:
        """Before decoding (free): the experts of `first` (the device pool), then in layer order."""
        flat = first.ravel()
        order = np.concatenate([np.flatnonzero(flat), np.flatnonzero(~flat)])[: self.slots]
        self.in_host.ravel()[order] = True
        self.n_in = len(order)

    def rank(self, utility) -> None:
        """The policy's scores after its plan (planned tier)."""
        self.score = np.asarray(utility, dtype=np.float64)

    def pass_done(self) -> None:
        self.expected[...] = False

    # ---- reads -----------------------------------------------------------------------------
    def read_ahead(self, wanted: np.ndarray, now: float, pinned: np.ndarray, ranked: bool = True) -> None:
        """Read the experts of `wanted` not in the tier, queued on the disk in layer order. ranked:
        when the tier is full only those ranked above the experts they would evict (a tier smaller
        than a pass would otherwise trade what the next pass needs for what it might); False: all
        (a read-ahead that knows the next pass)."""
        self.expected |= wanted
        flat = self._admit(np.flatnonzero((wanted & ~self.in_host).ravel()), now, pinned, self.expected, ranked)
        if len(flat):
            self.arrives_at.ravel()[flat] = self._queue(len(flat), now)
            self.reads_ahead += len(flat)

    def ready(self, layer: int, experts: np.ndarray, t: float, pinned: np.ndarray) -> float:
        """When `experts` of `layer`, needed from host memory by a layer starting at t, are there:
        those on the disk are read now, all at once (a stall) or by page faults."""
        if not len(experts):
            return t
        flat = layer * self.n_expert + np.asarray(experts)
        self.last_used.ravel()[flat] = t
        missing = flat[~self.in_host.ravel()[flat]]
        read = t
        if len(missing):
            protected = self.expected.copy()  # what the rest of the pass was read ahead for, and this layer's
            protected[: layer + 1] = False
            protected.ravel()[flat] = True
            read = self._read_now(missing, t, pinned, protected)
        # after the reads: they land the queued ones later
        done = max(float(self.arrives_at.ravel()[flat].max()), read, t)
        self.wait_s += done - t
        return done

    def source(self, layer: int, expert: int, t: float, pinned: np.ndarray) -> float:
        """When the device can copy `expert` from host memory, from t: a plan's copy, whose read
        (if on the disk) is queued behind the reads ahead (planned), or faulted in (mmap)."""
        flat = layer * self.n_expert + expert
        self.last_used.ravel()[flat] = t
        if not self.in_host.ravel()[flat]:
            wanted = np.zeros_like(self.in_host)
            wanted[layer, expert] = True
            if not self.planned:
                return self._read_now(np.array([flat]), t, pinned, wanted | self.expected)
            self.read_ahead(wanted, t, pinned)
            if not self.in_host.ravel()[flat]:  # no slot: read for the copy alone
                return float(self._queue(1, t)[0])
        return max(t, float(self.arrives_at.ravel()[flat]))

    def _read_now(self, flat: np.ndarray, t: float, pinned: np.ndarray, protected: np.ndarray) -> float:
        """Read `flat` (on the disk) at t ahead of the queue: one batch (planned) or page faults
        (mmap); they take slots if they can. Returns when they have landed."""
        n = len(flat)
        took = (self.disk.read_s(n, n * self.expert_bytes) if self.planned
                else self.disk.fault_s(n, self.expert_bytes, self.fault_threads))
        if self.disk_free_at > t:  # the queued reads land later by as much
            self.arrives_at[self.arrives_at > t] += took
            self.disk_free_at += took
        else:
            self.disk_free_at = t + took
        self.arrives_at.ravel()[self._admit(flat, t, pinned, protected)] = t + took
        self.bytes_read += n * self.expert_bytes
        self.stalls += n
        return t + took

    # ---- the disk queue and the slots -------------------------------------------------------
    def _queue(self, n: int, now: float) -> np.ndarray:
        """Arrivals of n reads issued at `now` behind the queued ones, queue_depth in flight."""
        k = np.arange(1, n + 1)
        start = max(now, self.disk_free_at)
        arrival = start + np.ceil(k / max(self.disk.queue_depth, 1)) * self.disk.latency_s \
            + k * self.expert_bytes / self.disk.read_bytes_per_s
        self.disk_free_at = float(arrival[-1])
        self.bytes_read += n * self.expert_bytes
        return arrival

    def _admit(self, flat: np.ndarray, now: float, pinned: np.ndarray, protected: np.ndarray,
               ranked: bool = False) -> np.ndarray:
        """Take slots for `flat` (in order), evicting the lowest-ranked (planned) or least recently
        used (mmap) experts that have landed and are not pinned (the device pool's, planned) or
        protected; returns those that got one. ranked: beyond the free slots, only the experts of
        `flat` ranked above their victim, highest first."""
        free = self.slots - self.n_in
        if ranked and len(flat) > free:
            flat = flat[np.argsort(-self.score.ravel()[flat], kind="stable")]
            victims = self._victims(len(flat) - free, now, pinned, protected)
            better = self.score.ravel()[flat[free:free + len(victims)]] > self.score.ravel()[victims]
            flat = np.sort(flat[:free + int(better.sum())])  # the reads in layer order
        victims = self._victims(len(flat) - free, now, pinned, protected)
        self.in_host.ravel()[victims] = False
        self.arrives_at.ravel()[victims] = -np.inf
        self.n_in -= len(victims)
        admitted = flat[: self.slots - self.n_in]
        self.in_host.ravel()[admitted] = True
        self.n_in += len(admitted)
        return admitted

    def _victims(self, n: int, now: float, pinned: np.ndarray, protected: np.ndarray) -> np.ndarray:
        """Up to n experts to evict, first victim first: landed, not protected, not the pool's
        (planned); the lowest-ranked (planned, ties: least recently used) or least recently used."""
        candidates = self.in_host & (self.arrives_at <= now) & ~protected
        if self.planned:
            candidates &= ~pinned
            key = self.score + 1e-9 * self.last_used
        else:
            key = self.last_used
        n = min(n, int(candidates.sum()))
        if n <= 0:
            return np.zeros(0, dtype=np.intp)
        key = np.where(candidates, key, np.inf).ravel()
        victims = np.argpartition(key, n - 1)[:n]
        return victims[np.argsort(key[victims], kind="stable")]
