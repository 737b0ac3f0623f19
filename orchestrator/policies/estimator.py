"""Speculative Utility Estimator (MoE-SpAc §3.2, Algorithm 1), vectorised over [MoE layer, expert].

After each verification step t the estimator turns the activation frequencies f_t (how many
of the verified tokens chose each expert) into utilities s_{t+1} in 0..K for the next step:

    Δ = f_t − f_{t−1}
    s ← min(K, s+1) if Δ ≥ θ↑ ; max(0, s−1) else if −Δ ≥ θ↓ ; else s     (inertial transition)
    θ↑ ← ⌊(1−λ)θ↑ + λΔ⌋ if Δ > 0 ; θ↓ ← ⌊(1−λ)θ↓ + λ|Δ|⌋ if Δ < 0      (adaptive calibration)

Order, as in Algorithm 1: the transition compares Δ with the boundaries of step t, and only
then are the boundaries of step t+1 calibrated. The up test comes first, so when both tests
hold (possible only if Δ = 0 and θ↑ = θ↓ = 0, e.g. γ = 1) the utility rises.

Where the paper is silent:
- f_0 = 0: nothing is activated before the first verification step, so Δ_1 = f_1. Feed only
  verification steps (or single decodes), not the prompt's prefill.
- λ is used as the exact fraction p/q nearest to it (denominator ≤ 1000, so 0.1 is 1/10) and the
  floor is taken in integer arithmetic: ⌊((q−p)θ + pΔ) / q⌋. In binary floating point
  (1−0.3)·3 + 0.3·3 is 2.9999999999999996, and the floor would follow the rounding noise.
- γ may change between steps (the orchestrator adapts the draft length). Calibrated
  boundaries are kept, since they track the observed fluctuation; γ only sets the initial
  boundaries ⌊γ/2⌋ used by `reset`. The paper asks K ≤ γ; that is not enforced, so K = 4 stays
  usable with γ = 1.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

# Fixed boundaries of the "w/o AdaBC" ablation (paper Table 4).
FIXED_THETA_UP = 3
FIXED_THETA_DOWN = 1


class UtilityEstimator:
    """Per-expert utilities s in 0..K from the activation frequencies of each verification step.

    adaptive=False: boundaries fixed at θ↑ = 3, θ↓ = 1 ("--no-adabc").
    binary=True:    K = 1 and an expert's utility is 1 iff the last step used it ("--no-utility").
    `gamma` may be reassigned between steps; it takes effect at the next `reset`.
    """

    def __init__(
        self,
        n_layer: int,
        n_expert: int,
        gamma: int = 8,
        k_max: int = 4,
        lam: float = 0.1,
        adaptive: bool = True,
        binary: bool = False,
    ) -> None:
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        if not 1 <= k_max <= 127:  # utilities are kept as int8
            raise ValueError(f"k_max must be in 1..127, got {k_max}")
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.gamma = gamma
        self.k_max = 1 if binary else k_max
        self.lam = lam
        self.adaptive = adaptive
        self.binary = binary
        frac = Fraction(lam).limit_denominator(1000)
        self._lam_p, self._lam_q = frac.numerator, frac.denominator

        shape = (n_layer, n_expert)
        self._utility = np.zeros(shape, dtype=np.int8)  # signed: s − 1 may dip below 0 before the clamp
        self._freq_prev = np.zeros(shape, dtype=np.int32)
        # The up side and the down side share each op: theta = [θ↑; θ↓], change = [Δ; −Δ].
        self._theta = np.zeros((2, *shape), dtype=np.int32)
        self._change = np.empty((2, *shape), dtype=np.int32)
        # scratch and constants: a step allocates only the returned copy, and array-array
        # ufuncs skip the cost numpy pays for promoting a Python scalar
        self._crossed = np.empty((2, *shape), dtype=bool)
        self._gate = np.empty((2, *shape), dtype=np.int32)
        self._step = np.empty((2, *shape), dtype=np.int32)
        self._zero_i32 = np.zeros((2, *shape), dtype=np.int32)
        self._one_i32 = np.ones((2, *shape), dtype=np.int32)
        self._zero_i8 = np.zeros(shape, dtype=np.int8)
        self._k_i8 = np.full(shape, self.k_max, dtype=np.int8)
        self.reset()

    def reset(self) -> None:
        """Back to step 1: s = 0, θ↑ = θ↓ = ⌊γ/2⌋ (or the fixed ablation values), f_0 = 0."""
        self._utility.fill(0)
        self._freq_prev.fill(0)
        if self.adaptive:
            self._theta.fill(self.gamma // 2)
        else:
            self._theta[0].fill(FIXED_THETA_UP)
            self._theta[1].fill(FIXED_THETA_DOWN)

    @property
    def utility(self) -> np.ndarray:
        """uint8 [n_layer, n_expert], the utilities for the next step (read-only view)."""
        return _readonly(self._utility.view(np.uint8))

    @property
    def theta_up(self) -> np.ndarray:
        """int32 [n_layer, n_expert], θ↑ for the next step (read-only view)."""
        return _readonly(self._theta[0])

    @property
    def theta_down(self) -> np.ndarray:
        """int32 [n_layer, n_expert], θ↓ for the next step (read-only view)."""
        return _readonly(self._theta[1])

    def update(self, freq: np.ndarray) -> np.ndarray:
        """One verification step: f_t (int [n_layer, n_expert]) → s_{t+1}, a new uint8 array."""
        if freq.shape != self._utility.shape:
            raise ValueError(f"freq has shape {freq.shape}, expected {self._utility.shape}")
        s, change, theta = self._utility, self._change, self._theta
        if self.binary:
            np.greater(freq, 0, out=s, casting="unsafe")
            np.copyto(self._freq_prev, freq, casting="unsafe")
            return s.astype(np.uint8)

        np.subtract(freq, self._freq_prev, out=change[0], casting="unsafe")  # Δ
        np.negative(change[0], out=change[1])  # −Δ
        np.copyto(self._freq_prev, freq, casting="unsafe")

        # Inertial transition, with the boundaries of step t: up where Δ ≥ θ↑, else down
        # where −Δ ≥ θ↓.
        up, down = self._crossed
        np.greater_equal(change, theta, out=self._crossed)
        np.greater(down, up, out=down)  # down and not up
        np.add(s, up.view(np.int8), out=s)
        np.subtract(s, down.view(np.int8), out=s)
        np.minimum(s, self._k_i8, out=s)
        np.maximum(s, self._zero_i8, out=s)

        # Adaptive boundary calibration for step t+1, where the change is > 0:
        # ⌊(1−λ)θ + λ·change⌋ = θ + ⌊p(change − θ)/q⌋ for λ = p/q, since qθ/q is whole.
        if self.adaptive:
            gate, step = self._gate, self._step
            np.minimum(change, self._one_i32, out=gate)  # 1 where change > 0, else ≤ 0 ...
            np.maximum(gate, self._zero_i32, out=gate)  # ... then 0: a cast-free mask
            np.subtract(change, theta, out=step)
            if self._lam_p != 1:
                step *= self._lam_p
            step //= self._lam_q  # numpy's // floors, also below 0
            step *= gate
            theta += step
        return s.astype(np.uint8)


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view
