"""The host tier of a model larger than RAM: disk → host → device (issue 50).

When the GGUF file does not fit the host budget (--host-budget; by default the memory available
now, less a margin), the routed experts stay on the disk: patch 0030 leaves them out of the load,
and each MoE layer's gate asks for its chosen experts not in memory all at once, before the matmuls
touch them (a stall). This tier decides which experts stay in memory, within its bytes: after every
pass it reads ahead, in the background, the experts the next pass will likely use (the pass's own
choices, ranked by how often and how lately each was chosen, and the draft's choices of the tokens
it drafts), and drops the lowest-ranked ones. Where an expert is read from changes, never what is
computed.

`HostTiers` is the sizing, decided before loading (and printed by --dry-run); `HostTier` the live
part, one per session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from orchestrator.runtime.native import DISK_DROP, DISK_READ
from orchestrator.runtime.pool import parse_size

# what the budget leaves for everything but the weights (the KV cache, compute buffers, the
# interpreter's own growth): an eighth of the memory available, at least this
MARGIN_MIN_BYTES = 64 << 20
MARGIN_FRACTION = 0.125
# the ranking's memory: a choice counts this much less after every pass
DECAY = 0.8
# a read ahead after a pass only for an expert chosen at least this many times as often per pass
# lately (its decayed count times 1 - DECAY) as uniform routing would choose it (top_k / n_expert:
# 6% on Qwen3-30B-A3B, 3% on gpt-oss-120b): below it, a read is likelier wasted than used. The
# draft's choices are read ahead whatever their count. Relative to the model's own uniform rate,
# not one rate for all: a fixed 0.25 (4x Qwen3-30B-A3B's, 8x gpt-oss-120b's) cost the simulated
# gpt-oss-120b up to 14% (docs/simulator.md)
READ_AHEAD_OVER_UNIFORM = 2.0


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup can still take (its limit less what it holds beyond
    the page cache, which the kernel reclaims), None without a limit. cgroup v2, then v1."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            files = ("memory.max", "memory.current", "file ")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache ")
        else:
            continue
        try:
            limit = (base / files[0]).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                return None
            used = int((base / files[1]).read_text())
            cache = next((int(s.split()[1]) for s in (base / "memory.stat").read_text().splitlines()
                          if s.startswith(files[2])), 0)
        except (OSError, ValueError):
            continue
        return max(int(limit) - (used - cache), 0)
    return None


def memory_available() -> int:
    """Bytes this process can still use: the machine's available memory, or its memory cgroup's
    room where that is smaller."""
    room = _cgroup_room()
    available = psutil.virtual_memory().available
    return min(available, room) if room is not None else available


@dataclass(frozen=True)
class HostBudget:
    """--host-budget, parsed once: `nbytes`, or `ratio` of the memory available; neither: the
    default (the memory available less the margin)."""

    nbytes: int = 0
    ratio: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> HostBudget:
        if text is None or text.strip().lower() == "auto":
            return cls()
        hint = "give bytes (24G, 48GiB) or a percentage of the memory available now (80%)"
        nbytes, ratio = parse_size(text, hint)
        if not ratio and nbytes <= 0:
            raise ValueError(f"{text!r}: {hint}")
        return cls(nbytes, ratio)

    def resolve(self, available: int) -> int:
        if self.nbytes:
            return self.nbytes
        if self.ratio:
            return int(available * self.ratio)
        return available - max(MARGIN_MIN_BYTES, int(available * MARGIN_FRACTION))


def check_host_budget(text: str | None) -> str | None:
    """--host-budget's check (the option declaration's): the text, once it parses."""
    HostBudget.parse(text)
    return text


@dataclass(frozen=True)
class HostTiers:
    """Where the weights are read from: `budget` bytes of host memory for the model's weights
    hold the non-expert weights and `tier` bytes of experts; the other experts stay on the disk."""

    budget: int
    non_expert: int
    experts: int          # every routed expert's bytes
    one_expert: int       # one expert's bytes (all its matrices)
    pool_host: int = 0    # an expert pool's copies in host memory (the CPU test device): out of the budget
    pool_device: int = 0  # an expert pool's copies on a device
    context: int = 0      # the KV caches in host memory

    @property
    def held(self) -> int:
        """What the budget holds before any expert: the other weights, a host pool, the KV caches."""
        return self.non_expert + self.pool_host + self.context

    @property
    def tier(self) -> int:
        return max(min(self.budget - self.held, self.experts), 0)

    @property
    def on_disk(self) -> bool:
        return self.tier < self.experts

    @property
    def n_kept(self) -> int:
        """Experts the tier holds."""
        return self.tier // max(self.one_expert, 1)

    @property
    def n_experts(self) -> int:
        return self.experts // max(self.one_expert, 1)

    def lines(self) -> list[str]:
        gib = 2**30
        if not self.on_disk:
            return [f"host: every weight in memory ({(self.non_expert + self.experts) / gib:.2f} GiB; "
                    f"host budget {self.budget / gib:.2f} GiB)"]
        pool = self.pool_device + self.pool_host
        where = " in host memory: the CPU test device" if self.pool_host else ""
        device = [f"device: {pool / gib:.2f} GiB of experts (the pool{where})"] if pool else []
        return device + [
                f"host:   {self.tier / gib:.2f} GiB of experts ({self.n_kept} of {self.n_experts}) + {self.non_expert / gib:.2f} GiB of other weights + "
                f"{self.context / gib:.2f} GiB of KV cache (host budget {self.budget / gib:.2f} GiB, --host-budget)",
                f"disk:   {(self.experts - self.tier) / gib:.2f} GiB of experts, read when used or ahead"]


def plan_tiers(budget: HostBudget, non_expert: int, experts: int, one_expert: int, pool_host: int = 0,
               pool_device: int = 0, context: int = 0, available: int | None = None) -> HostTiers:
    """The tiers for a model of these sizes; ValueError when even the non-expert weights, a host
    pool and the KV caches do not fit beside one expert."""
    avail = memory_available() if available is None else available
    tiers = HostTiers(budget.resolve(avail), non_expert, experts, one_expert, pool_host, pool_device, context)
    if tiers.on_disk and tiers.budget < tiers.held + one_expert:
        raise ValueError(f"{tiers.budget / 2**30:.2f} GiB does not hold the model's "
                         f"{non_expert / 2**30:.2f} GiB of non-expert weights, one expert, "
                         f"{pool_host / 2**30:.2f} GiB of host pool (--expert-budget) and "
                         f"{context / 2**30:.2f} GiB of KV cache (-c) "
                         f"(memory available now: {avail / 2**30:.2f} GiB)")
    return tiers


def chosen(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(MoE layer, expert) of every choice in ids [n_moe_layers, n_tokens, k], -1s left out."""
    layer = np.broadcast_to(np.arange(ids.shape[0])[:, None, None], ids.shape)
    valid = ids >= 0
    return layer[valid], ids[valid]


class HostTier:
    """The experts kept in memory, for one model whose experts are on the disk.

    disk: a native.ExpertsOnDisk; capacity: how many experts the tier holds; read_ahead=False
    is the ablation that only keeps and drops (every miss then stalls its layer). The tier is
    exclusive of a device pool: an expert the device holds is not kept in host memory too (a
    copy to the device read it; were the pool to give it back, it is read from the disk again).
    `trace`, when a list, gets every pass's and lookahead's choices (bench/bench_disk.py replays
    them on a modelled disk)."""

    def __init__(self, disk, n_moe_layers: int, n_expert: int, capacity: int, read_ahead: bool = True):
        self.disk = disk
        self.capacity = max(int(capacity), 0)
        self.read_ahead = read_ahead
        self.score = np.zeros((n_moe_layers, n_expert), np.float64)
        self.resident = np.zeros((n_moe_layers, n_expert), bool)
        self.on_device = np.zeros((n_moe_layers, n_expert), bool)
        self.n_passes = 0
        self.min_rate = 0.0  # READ_AHEAD_OVER_UNIFORM × top_k / n_expert, once a pass shows top_k
        self.busy_s = 0.0  # time spent ranking, reading ahead and dropping, on the loop's thread
        self.trace: list | None = None

    def after_pass(self, ids: np.ndarray, on_device: np.ndarray | None = None) -> None:
        """ids: the pass's choices, [n_moe_layers, n_tokens, k]; on_device: what the device pool
        holds now ([n_moe_layers, n_expert] bool). The choices are in memory now (their gates read
        them); rank again, read ahead what ranks in and is not in memory, drop what ranks out."""
        if self.trace is not None:
            self.trace.append(("pass", ids.copy(), None if on_device is None else on_device.copy()))
        if on_device is not None and not np.array_equal(on_device, self.on_device):
            self.on_device = on_device
            self.disk.set_on_device(on_device)
        self.n_passes += 1
        self.min_rate = READ_AHEAD_OVER_UNIFORM * ids.shape[-1] / self.score.shape[1]
        layer, expert = chosen(ids)
        np.add.at(self.score, (layer, expert), 1.0)  # once per token that chose it
        used = np.zeros_like(self.resident)
        used[layer, expert] = True
        self.score *= DECAY
        self.resident |= used & ~self.on_device  # the device computed its own: their gates read nothing
        self._settle(keep=used)

    def lookahead(self, ids: np.ndarray) -> None:
        """The draft's choices for tokens the next pass verifies ([n_moe_layers, n_tokens, k]):
        ranked first, and read now."""
        if self.trace is not None:
            self.trace.append(("lookahead", ids.copy(), None))
        wanted = np.zeros_like(self.resident)
        wanted[chosen(ids)] = True
        self.score[wanted] += 1.0
        self._settle(keep=wanted)

    def _settle(self, keep: np.ndarray) -> None:
        """Hold the `capacity` best-ranked experts (`keep` first): read those not in memory,
        drop the others."""
        t0 = time.perf_counter()
        rank = (self.score + keep * 1e9) * ~self.on_device  # what the passes need now outranks any history
        flat = np.argsort(-rank, axis=None, kind="stable")[:self.capacity]
        want = np.zeros(self.resident.size, bool)
        want[flat] = True
        want = want.reshape(self.resident.shape) & (rank > 0)
        drop = self.resident & ~want
        if drop.any():
            self.disk.advise(np.argwhere(drop), DISK_DROP)
        self.resident &= ~drop
        if self.read_ahead:
            read = want & ~self.resident & (keep | (self.score * (1 - DECAY) >= self.min_rate))
            if read.any():
                self.disk.advise(np.argwhere(read), DISK_READ)
                self.resident |= read
        self.busy_s += time.perf_counter() - t0

    def stats(self) -> dict:
        s = self.disk.stats()
        return {"capacity": self.capacity, "resident": int(self.resident.sum()), "read_ahead": self.read_ahead,
                "busy_s": self.busy_s,
                "hits": s["n_gate_experts"] - s["n_stalls"], "stalls": s["n_stalls"],
                "bytes_read": s["bytes_stalled"] + s["bytes_read_ahead"], **s}

