"""Heterogeneous Workload Balancer (MoE-SpAc §3.3, Eq. 9–12 and Appendix C).

Per MoE layer and verification step, choose the threshold τ ∈ [1, K] (experts with
utility ≥ τ are hot: prefetched to and computed on the device) that minimises

    |T_cpu(τ) − T_gpu(τ)|,  T_cpu = r_c(τ)·(γ+1)·k·T^u_cpu,  T_gpu = r_g(τ)·b·T^u_gpu     (9)
    s.t. T^u_io·n(τ) ≤ T_total + γ·T^u_draft / L_target                                 (10)
         W^u_e·n(τ) ≤ VRAM_left                                                          (11)
         τ ∈ {1, …, K}                                                                   (12)

Quantities, per layer:
    r_c(τ)  share of the step's expert activations (token, expert pairs) whose expert has
            utility < τ, i.e. is computed on the host. Non-decreasing in τ.
    r_g(τ)  share of the b distinct activated experts that have utility ≥ τ, i.e. are
            computed on the device, one batched call each. Non-increasing in τ.
    b       number of distinct activated experts in the step.
    n(τ)    experts with utility ≥ τ that are not resident yet: what must be prefetched.

Eq. 7 of the paper writes γ·k activations; a verify pass holds γ+1 tokens (the drafts and the
token after them), so the actual count (γ+1)·k is used.

r_c, r_g and b are estimated online (`WorkloadStats`): after step t, the utilities that were in
force during step t (the prediction) are paired with the routing of step t (the outcome), and
the per-τ shares enter an exponential moving average. Pairing the prediction with its own
outcome matters: the utilities computed from step t are biased towards step t's routing.

The unit costs and budgets are measured by the caller (`UnitCosts`), never constants here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# Threshold of the "w/o HetWB" ablation (paper Table 4).
FIXED_THRESHOLD = 2


@dataclass
class UnitCosts:
    """Measured unit costs and budgets; each field is a scalar or an array [n_layer].

    t_cpu_unit:    T^u_cpu, s, one expert on one token on the host
    t_gpu_unit:    T^u_gpu, s, one expert's batched call on the device (all its tokens)
    t_io_unit:     T^u_io, s, copying one expert host → device
    expert_bytes:  W^u_e, bytes of one expert
    t_draft_token: T^u_draft, s, the draft model's time per drafted token
    t_total:       T_total, s, one layer's execution time in a verify step (measured on the
                   last steps; taken as given so the I/O window does not depend on τ)
    vram_left:     VRAM_left, bytes free for this layer's prefetch
    """

    t_cpu_unit: float | np.ndarray
    t_gpu_unit: float | np.ndarray
    t_io_unit: float | np.ndarray
    expert_bytes: float | np.ndarray
    t_draft_token: float | np.ndarray
    t_total: float | np.ndarray
    vram_left: float | np.ndarray


class WorkloadStats:
    """Online estimates of r_c(τ), r_g(τ) [n_layer, K] and b [n_layer].

    Exponential moving average with weight `decay` on the newest step (0.1: about the last ten
    steps; per layer r_c and r_g move slowly, Appendix C.1), the first observation taken as is.
    Before any observation r_c = 1, r_g = 0, b = 0 (nothing is hot yet). Column τ−1 holds the
    value at threshold τ.
    """

    def __init__(self, n_layer: int, k_max: int, decay: float = 0.1) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.n_layer = n_layer
        self.k_max = k_max
        self.decay = decay
        # One array for the whole estimate, so that each op of a step updates all of it:
        # [0] activations, [1] distinct activated experts; columns τ−1 = r_c(τ) and r_g(τ),
        # column K = the totals, (γ+1)·k and b.
        self._table = np.empty((2, n_layer, k_max + 1))
        # counts per utility level @ _to_tau: per τ the activations with utility < τ and the
        # distinct experts with utility ≥ τ, then all of them
        self._to_tau = np.stack([_below(k_max), _at_least(k_max)])
        self._to_tau = np.concatenate([self._to_tau, np.ones((2, k_max + 1, 1))], axis=2)
        self.reset()

    @property
    def r_cpu(self) -> np.ndarray:
        return self._table[0, :, :-1]

    @property
    def r_gpu(self) -> np.ndarray:
        return self._table[1, :, :-1]

    @property
    def b(self) -> np.ndarray:
        return self._table[1, :, -1]

    def reset(self) -> None:
        self._table[0] = 1.0  # r_c = 1
        self._table[1] = 0.0  # r_g = 0, b = 0
        self.n_observed = 0

    def observe(self, freq: np.ndarray, utility: np.ndarray) -> None:
        """Pair the routing of one step (f_t) with the utilities that were in force during it."""
        self.observe_levels(freq, utility_levels(utility, self.k_max))

    def observe_levels(self, freq: np.ndarray, level: np.ndarray) -> None:
        """`observe` with the utilities given as `utility_levels` (the balancer keeps those)."""
        n_bin = self.n_layer * (self.k_max + 1)
        # per layer and utility level: activations, and distinct activated experts
        counts = np.empty((2, n_bin))
        counts[0] = np.bincount(level, weights=freq.ravel(), minlength=n_bin)
        counts[1] = np.bincount(level, weights=(freq > 0).ravel(), minlength=n_bin)
        new = counts.reshape(2, self.n_layer, -1) @ self._to_tau
        new[:, :, :-1] /= np.maximum(new[:, :, -1:], 1.0)
        if self.n_observed == 0:
            self._table[...] = new
        else:
            new -= self._table
            new *= self.decay
            self._table += new
        self.n_observed += 1


class WorkloadBalancer:
    """Threshold τ per layer for the next step from utilities, residency and measured costs.

    fixed_threshold: τ for every layer instead of solving (the "--no-balancer" ablation uses
    FIXED_THRESHOLD = 2), clipped to [1, K].
    n_layer_target: L_target of Eq. 10, the target's layer count over which the draft time is
    spread; defaults to n_layer (the MoE layers).
    """

    def __init__(
        self,
        n_layer: int,
        n_expert: int,
        top_k: int,
        k_max: int = 4,
        decay: float = 0.1,
        fixed_threshold: int | None = None,
        n_layer_target: int | None = None,
    ) -> None:
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.top_k = top_k
        self.k_max = k_max
        self.fixed_threshold = fixed_threshold
        self.n_layer_target = n_layer_target or n_layer
        self.stats = WorkloadStats(n_layer, k_max, decay)
        self._level_offset = np.repeat(_level_offset(n_layer, k_max), n_expert, axis=1)
        # levels of the utilities in force during the step being verified, and of the next ones
        self._level_in_force = np.empty(n_layer * n_expert, dtype=np.intp)
        self._level_next = np.empty(n_layer * n_expert, dtype=np.intp)
        self.reset()

    def reset(self) -> None:
        self.stats.reset()
        self._level_in_force[:] = self._level_offset.ravel()  # all utilities 0

    def update(
        self,
        freq: np.ndarray,
        utility: np.ndarray,
        resident: np.ndarray | None,
        costs: UnitCosts,
        gamma: int,
    ) -> np.ndarray:
        """After step t: learn from f_t, then choose τ (int32 [n_layer]) for step t+1.

        freq: f_t [n_layer, n_expert]; utility: s_{t+1} in 0..K from the estimator; resident:
        bool [n_layer, n_expert], experts on the device now (None: none); gamma: the next
        draft length.
        """
        if self.fixed_threshold is not None:
            tau = min(max(self.fixed_threshold, 1), self.k_max)
            return np.full(self.n_layer, tau, dtype=np.int32)
        self.stats.observe_levels(freq, self._level_in_force)
        level = self._level_next
        np.add(self._level_offset, utility, out=level.reshape(self._level_offset.shape), casting="unsafe")
        self._level_in_force, self._level_next = level, self._level_in_force
        n_new = prefetch_count(level, resident, self.n_layer, self.k_max)
        return solve_threshold(
            self.stats.r_cpu, self.stats.r_gpu, self.stats.b, n_new,
            costs, gamma, self.top_k, self.n_layer_target,
        )


def solve_threshold(
    r_cpu: np.ndarray,
    r_gpu: np.ndarray,
    b: np.ndarray,
    n_new: np.ndarray,
    costs: UnitCosts,
    gamma: int,
    top_k: int,
    n_layer_target: int,
) -> np.ndarray:
    """Eq. 9–12 for every layer at once: τ*, int32 [n_layer] in 1..K.

    r_cpu, r_gpu, n_new: [n_layer, K], column τ−1 for threshold τ; r_cpu non-decreasing,
    r_gpu and n_new non-increasing in τ. b: [n_layer].

    Because n(τ) is non-increasing, both constraints are upper bounds that hold from some τ_min
    on: the feasible set is [τ_min, K], empty ⇒ τ = K. The gap T_cpu − T_gpu is non-decreasing,
    so |gap| is smallest next to its sign change c (first τ with gap ≥ 0): at c−1 or c, moved
    into [τ_min, K] (Appendix C, Eq. 39). Ties go to the larger τ, which copies fewer experts for
    the same balance. The gap is flat exactly where a utility level saw no activations, so on
    the right of c the candidate is the last τ whose gap equals gap(c). (With r_c, r_g given as
    tables over τ this is O(K) per layer like a search; the point is the vectorised form.)
    """
    n_layer, k_max = r_cpu.shape
    gap = r_cpu * _per_layer((gamma + 1) * top_k * costs.t_cpu_unit)
    gap -= r_gpu * _per_layer(b * costs.t_gpu_unit)

    n_max = prefetch_limit(costs, gamma, n_layer_target)
    tau_min = 1 + _count(n_new > _per_layer(n_max))  # K+1: nothing feasible

    # left: c − 1, the last τ with gap < 0 (0: none); right: the first feasible τ with gap ≥ 0,
    # then the last τ with the same gap. Where there is no such τ (K+1), K is the answer: all
    # gaps < 0 or nothing feasible; `right` comes out as K there and `use_left` false.
    flat_gap = gap.ravel()
    row = np.arange(-1, n_layer * k_max - 1, k_max)  # flat index of τ = 0 in each row
    left = _count(gap < 0)
    right = np.minimum(np.maximum(left + 1, tau_min), k_max)
    gap_right = flat_gap.take(row + right)
    right = _count(gap <= gap_right[:, None])
    # left wins when strictly closer to 0: −gap(left) < gap(right)
    use_left = (left >= tau_min) & (flat_gap.take(row + left) + gap_right > 0)
    return np.where(use_left, left, right).astype(np.int32)


def utility_levels(utility: np.ndarray, k_max: int) -> np.ndarray:
    """Flat bin index layer·(K+1) + utility (utility in 0..K): one bincount counts per level."""
    return (_level_offset(utility.shape[0], k_max) + utility).ravel()


def prefetch_count(level: np.ndarray, resident: np.ndarray | None, n_layer: int, k_max: int) -> np.ndarray:
    """n(τ): [n_layer, K] (float64, whole numbers), experts with utility ≥ τ not resident;
    column τ−1. level: `utility_levels` of the utilities."""
    n_bin = n_layer * (k_max + 1)
    if resident is None:
        per_level = np.bincount(level, minlength=n_bin).astype(np.float64)
    else:
        per_level = np.bincount(level, weights=~resident.ravel(), minlength=n_bin)
    return per_level.reshape(n_layer, k_max + 1) @ _at_least(k_max)


def _level_offset(n_layer: int, k_max: int) -> np.ndarray:
    return np.arange(0, n_layer * (k_max + 1), k_max + 1, dtype=np.intp)[:, None]


@lru_cache
def _below(k_max: int) -> np.ndarray:
    """[K+1, K]: entry (u, τ−1) is 1 when utility level u < τ."""
    return _frozen(np.arange(k_max + 1)[:, None] < np.arange(1, k_max + 1))


@lru_cache
def _at_least(k_max: int) -> np.ndarray:
    """[K+1, K]: entry (u, τ−1) is 1 when utility level u ≥ τ."""
    return _frozen(np.arange(k_max + 1)[:, None] >= np.arange(1, k_max + 1))


def _frozen(mask: np.ndarray) -> np.ndarray:
    """A cached 0/1 matrix as float64 (for BLAS), read-only since every caller shares it."""
    matrix = mask.astype(np.float64)
    matrix.flags.writeable = False
    return matrix


def prefetch_limit(costs: UnitCosts, gamma: int, n_layer_target: int) -> float | np.ndarray:
    """Eq. 10 and 11 as one bound on n(τ): how many experts can be copied within the compute
    and drafting window and fit in the free memory (per layer if the costs are)."""
    window = costs.t_total + gamma * costs.t_draft_token / n_layer_target
    in_time, in_memory = _ratio(window, costs.t_io_unit), _ratio(costs.vram_left, costs.expert_bytes)
    if isinstance(in_time, np.ndarray) or isinstance(in_memory, np.ndarray):
        return np.minimum(in_time, in_memory)
    return min(in_time, in_memory)  # plain floats stay in Python: no numpy call per step


def _ratio(budget, unit):
    """How many units fit in the budget; inf for a free unit."""
    if isinstance(budget, np.ndarray) or isinstance(unit, np.ndarray):
        with np.errstate(divide="ignore"):
            return np.divide(budget, unit)
    return budget / unit if unit > 0 else float("inf")


def _per_layer(x):
    """A cost as a column [n_layer, 1] if given per layer, else as it is."""
    return x[:, None] if isinstance(x, np.ndarray) and x.ndim else x


def _count(mask: np.ndarray) -> np.ndarray:
    """True per row (np.count_nonzero with an axis goes through slow Python checks)."""
    return np.add.reduce(mask, axis=1)
