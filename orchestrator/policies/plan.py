"""Plain data passed between a policy and whoever executes it (live engine or simulator).

A policy turns the routing of the last verification step into a `Plan`; the native
engine and the simulator both consume the same `Plan`. Nothing here has behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepRouting:
    """Routing of one verify pass (or one autoregressive decode) of the target.

    selected: int32 [n_tokens, n_layer, top_k]   expert ids chosen per token per MoE layer
    weights:  float32 [n_tokens, n_layer, top_k] their routing weights
    n_drafted / n_accepted: draft tokens proposed / accepted in this step
    position: tokens in the target's KV cache before the pass (None: not known), which its
              attention reads
    """

    selected: np.ndarray
    weights: np.ndarray | None = None
    n_drafted: int = 0
    n_accepted: int = 0
    position: int | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.selected.shape[0])

    def frequency(self, n_expert: int) -> np.ndarray:
        """f_t: int32 [n_layer, n_expert], how many verified tokens chose each expert. An id -1 (a
        row the layer did not compute: a prompt's last layer keeps only its output rows) counts
        nowhere."""
        n_layer = self.selected.shape[1]
        n_cells = n_layer * n_expert
        # one bincount over layer·n_expert + expert: np.add.at costs ~0.7 ms at 48×128, this ~20 µs
        cell = self.selected + (np.arange(n_layer, dtype=np.intp) * n_expert)[:, None]
        cell = np.where(self.selected >= 0, cell, n_cells)  # one spare bin for the -1 rows
        freq = np.bincount(cell.ravel(), minlength=n_cells + 1)[:n_cells]
        return freq.reshape(n_layer, n_expert).astype(np.int32)


@dataclass(frozen=True)
class Plan:
    """What to keep on the device after one verification step.

    utility:   uint8 [n_layer, n_expert], 0..K. Experts with utility >= threshold[layer]
               should be resident; prefetch serves high utility first, eviction takes low first.
    threshold: int32 [n_layer], tau per layer, 1..K.
    prefetch:  optional int32 [n, 2] (layer, expert) rows in priority order; when given it
               replaces the ranking derived from `utility` (baselines that are not utility-based).
    evict:     optional int32 [m, 2] (layer, expert) rows, first to evict first.
    """

    utility: np.ndarray
    threshold: np.ndarray
    prefetch: np.ndarray | None = None
    evict: np.ndarray | None = None

    def wanted(self) -> np.ndarray:
        """bool [n_layer, n_expert]: experts this plan wants resident."""
        return self.utility >= self.threshold[:, None]
