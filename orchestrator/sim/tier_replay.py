"""A live run's host tier replayed on a modelled disk: the decode time it predicts.

bench/bench_disk.py records every target pass's choices (and the pool draft's lookaheads) of a
live run whose experts are on the disk, and the decode time of the same run with every weight in
memory. This replays those choices through the live tier's own ranking (runtime/host_tier.py's
HostTier, over a `ModelledDisk` instead of the native one) and adds the disk's time:

    a pass's stall      each MoE layer's chosen experts not in memory, read at once while the layer
                        waits: Disk.read_s(3 reads per expert, their bytes)
    a read ahead        issued after a pass or a draft token, it runs while the next pass computes:
                        only what it takes beyond that pass's compute time is waited for

predicted decode time = the in-memory run's decode time + the stalls + the reads ahead's excess.
The prompt's pass is replayed (it fills the tier) but not timed, as the live decode time leaves it
out.
"""

from __future__ import annotations

import numpy as np

from orchestrator.sim.disk import Disk

READS_PER_EXPERT = 3  # an expert's gate, up and down matrices: three ranges of the file


class ModelledDisk:
    """What the live tier asks of the native disk, kept as sets: an expert is in memory once read
    (by a gate or a read ahead) until dropped. `pending` holds the reads ahead not yet waited for."""

    def __init__(self, n_layer: int, n_expert: int):
        self.in_memory = np.zeros((n_layer, n_expert), bool)
        self.pending = np.zeros((n_layer, n_expert), bool)
        self.on_device = np.zeros((n_layer, n_expert), bool)

    def advise(self, pairs, advice: int) -> int:
        from orchestrator.runtime.native import DISK_READ

        p = np.asarray(pairs).reshape(-1, 2)
        if advice == DISK_READ:
            self.pending[p[:, 0], p[:, 1]] |= ~self.in_memory[p[:, 0], p[:, 1]]
            self.in_memory[p[:, 0], p[:, 1]] = True
        else:
            self.in_memory[p[:, 0], p[:, 1]] = False
            self.pending[p[:, 0], p[:, 1]] = False
        return len(p)

    def set_on_device(self, on_device) -> None:
        self.on_device = np.asarray(on_device, bool)

    def stats(self) -> dict:
        return dict.fromkeys(("n_gate_experts", "n_stalls", "bytes_stalled", "n_read_ahead", "bytes_read_ahead",
                              "n_dropped"), 0)


def replay(trace: list, capacity: int, n_expert: int, expert_bytes: float, disk: Disk, t_decode_memory: float,
           read_ahead: bool = True) -> dict:
    """trace: HostTier.trace of a live run, [(kind, ids [n_layer, n_tokens, k], on_device or None)];
    t_decode_memory: that run's decode seconds with every weight in memory. Returns the predicted
    decode seconds, and the stalls and bytes read the replay counted."""
    from orchestrator.runtime.host_tier import HostTier

    n_layer = trace[0][1].shape[0]
    modelled = ModelledDisk(n_layer, n_expert)
    tier = HostTier(modelled, n_layer, n_expert, capacity, read_ahead=read_ahead)
    t_pass = t_decode_memory / max(sum(1 for kind, *_ in trace[1:] if kind == "pass"), 1)
    stall_s = ahead_s = 0.0
    n_stalls = n_bytes = 0
    for i, (kind, ids, on_device) in enumerate(trace):
        if kind == "lookahead":
            tier.lookahead(ids)
            continue
        if on_device is not None:
            modelled.set_on_device(on_device)
        pending = modelled.pending.sum()
        if i > 0 and pending:  # the reads ahead ran while this pass computed
            ahead_s += max(disk.read_s(READS_PER_EXPERT * int(pending), pending * expert_bytes) - t_pass, 0.0)
        modelled.pending[:] = False
        for m in range(n_layer):
            chosen = np.unique(ids[m][ids[m] >= 0])
            chosen = chosen[~modelled.on_device[m, chosen]]
            missing = chosen[~modelled.in_memory[m, chosen]]
            if missing.size:
                n_stalls += missing.size
                n_bytes += int(missing.size * expert_bytes)
                if i > 0:
                    stall_s += disk.read_s(READS_PER_EXPERT * missing.size, missing.size * expert_bytes)
                modelled.in_memory[m, missing] = True
        tier.after_pass(ids, on_device)
    return {"decode_s": t_decode_memory + stall_s + ahead_s, "stall_s": stall_s, "read_ahead_wait_s": ahead_s,
            "stalls": n_stalls, "bytes_read": n_bytes}
