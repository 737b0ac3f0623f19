"""Speculative Utility Estimator against hand-worked runs of Algorithm 1 (MoE-SpAc §3.2)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.policies.estimator import FIXED_THETA_DOWN, FIXED_THETA_UP, UtilityEstimator
from orchestrator.policies.plan import StepRouting


def run_single(est: UtilityEstimator, freqs: list[int]) -> list[tuple[int, int, int]]:
    """Feed one expert's frequencies; (s, θ↑, θ↓) after each step."""
    rows = []
    for f in freqs:
        est.update(np.array([[f]], dtype=np.int32))
        rows.append((int(est.utility[0, 0]), int(est.theta_up[0, 0]), int(est.theta_down[0, 0])))
    return rows


# γ = 8 (θ↑ = θ↓ = 4), K = 4, λ = 0.1. Columns: f_t, then s, θ↑, θ↓ after step t.
TABLE_GAMMA8 = [
    # f   s  θ↑ θ↓     Δ
    (6,   1, 4, 4),  # +6 ≥ 4: up;  θ↑ = ⌊3.6 + 0.6⌋ = ⌊4.2⌋ = 4   (f_0 = 0)
    (9,   1, 3, 4),  # +3 < 4: hold (old θ↑; the new one, 3, would have moved it); θ↑ = ⌊3.9⌋ = 3, the floor
    (9,   1, 3, 4),  #  0: hold, no calibration
    (2,   0, 3, 4),  # −7, 7 ≥ 4: down; θ↓ = ⌊3.6 + 0.7⌋ = ⌊4.3⌋ = 4
    (5,   1, 3, 4),  # +3 ≥ 3: up; θ↑ = ⌊2.7 + 0.3⌋ = 3 exactly
    (1,   0, 3, 4),  # −4 ≥ 4: down; θ↓ = ⌊3.6 + 0.4⌋ = 4 exactly
    (1,   0, 3, 4),  #  0: hold
    (9,   1, 3, 4),  # +8: up; θ↑ = ⌊2.7 + 0.8⌋ = ⌊3.5⌋ = 3
    (5,   0, 3, 4),  # −4: down; θ↓ = 4
    (4,   0, 3, 3),  # −1 < 4: hold; θ↓ = ⌊3.6 + 0.1⌋ = ⌊3.7⌋ = 3, the floor
    (1,   0, 3, 3),  # −3 ≥ 3: down, but max(0, s−1) keeps 0; θ↓ = ⌊2.7 + 0.3⌋ = 3
]

# γ = 4 (θ↑ = θ↓ = 2), K = 2, λ = 0.1.
TABLE_GAMMA4_K2 = [
    # f   s  θ↑ θ↓
    (2,   1, 2, 2),  # +2 ≥ 2: up; θ↑ = ⌊1.8 + 0.2⌋ = 2
    (4,   2, 2, 2),  # +2: up to K
    (1,   1, 2, 2),  # −3: down; θ↓ = ⌊1.8 + 0.3⌋ = ⌊2.1⌋ = 2
    (3,   2, 2, 2),  # +2: up
    (5,   2, 2, 2),  # +2: up, but min(K, s+1) keeps K = 2
    (0,   1, 2, 2),  # −5: down; θ↓ = ⌊1.8 + 0.5⌋ = ⌊2.3⌋ = 2
    (0,   1, 2, 2),  #  0: hold
    (1,   1, 1, 2),  # +1 < 2: hold; θ↑ = ⌊1.9⌋ = 1
    (0,   1, 1, 1),  # −1 < 2: hold; θ↓ = ⌊1.9⌋ = 1
    (0,   1, 1, 1),  #  0: 0 < θ↑ and 0 < θ↓: hold
    (1,   2, 1, 1),  # +1 ≥ 1: up; θ↑ = ⌊0.9 + 0.1⌋ = 1
    (0,   1, 1, 1),  # −1 ≥ 1: down; θ↓ = 1
]

# γ = 1 gives θ↑ = θ↓ = ⌊1/2⌋ = 0: Δ = 0 passes both tests, and the up test comes first.
TABLE_GAMMA1 = [
    # f   s  θ↑ θ↓
    (0,   1, 0, 0),  #  0 ≥ 0: up (no calibration at Δ = 0)
    (0,   2, 0, 0),  #  0: up again
    (1,   3, 0, 0),  # +1: up; θ↑ = ⌊0.1⌋ = 0
    (0,   2, 0, 0),  # −1: 1 ≥ 0: down; θ↓ = ⌊0.1⌋ = 0
]


@pytest.mark.parametrize(
    ("gamma", "k_max", "table"),
    [(8, 4, TABLE_GAMMA8), (4, 2, TABLE_GAMMA4_K2), (1, 4, TABLE_GAMMA1)],
)
def test_hand_worked_sequences(gamma: int, k_max: int, table: list[tuple[int, int, int, int]]) -> None:
    est = UtilityEstimator(1, 1, gamma=gamma, k_max=k_max, lam=0.1)
    rows = run_single(est, [row[0] for row in table])
    assert rows == [row[1:] for row in table]


def test_columns_are_independent() -> None:
    """The three hand-worked runs side by side in one [n_layer, n_expert] array, one γ = 8."""
    table = TABLE_GAMMA8
    est = UtilityEstimator(2, 3, gamma=8, k_max=4)
    for f, s, up, down in table:
        freq = np.zeros((2, 3), dtype=np.int32)
        freq[1, 2] = f
        out = est.update(freq)
        assert (out[1, 2], est.theta_up[1, 2], est.theta_down[1, 2]) == (s, up, down)
        assert out[0].max() == 0 and out[1, :2].max() == 0


def test_update_returns_a_new_array() -> None:
    est = UtilityEstimator(1, 2, gamma=2, k_max=4)
    first = est.update(np.array([[2, 0]]))
    est.update(np.array([[4, 0]]))
    assert first.tolist() == [[1, 0]] and first.dtype == np.uint8
    assert est.utility.tolist() == [[2, 0]]
    with pytest.raises(ValueError):
        est.utility[0, 0] = 3


def test_no_adabc_keeps_fixed_boundaries() -> None:
    est = UtilityEstimator(1, 1, gamma=8, k_max=4, adaptive=False)
    # f: +3 ≥ 3 up; 0 hold; −1 ≥ 1 down; +7 up; −9 down
    rows = run_single(est, [3, 3, 2, 9, 0])
    assert rows == [(1, 3, 1), (1, 3, 1), (0, 3, 1), (1, 3, 1), (0, 3, 1)]
    assert (FIXED_THETA_UP, FIXED_THETA_DOWN) == (3, 1)


def test_binary_utility_is_use_in_the_last_step() -> None:
    est = UtilityEstimator(1, 3, gamma=8, k_max=4, binary=True)
    assert est.k_max == 1
    assert est.update(np.array([[0, 3, 1]])).tolist() == [[0, 1, 1]]
    assert est.update(np.array([[2, 0, 0]])).tolist() == [[1, 0, 0]]


def test_reset_and_gamma_change() -> None:
    est = UtilityEstimator(1, 1, gamma=8, k_max=4)
    run_single(est, [6, 9])
    est.gamma = 4  # calibrated boundaries survive a change of draft length
    assert (est.utility[0, 0], est.theta_up[0, 0]) == (1, 3)
    est.reset()  # the new γ sets the initial boundaries
    assert (est.utility[0, 0], est.theta_up[0, 0], est.theta_down[0, 0]) == (0, 2, 2)
    assert run_single(est, [2]) == [(1, 2, 2)]  # f_0 = 0 again after reset


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        UtilityEstimator(1, 1, lam=1.5)
    with pytest.raises(ValueError):
        UtilityEstimator(1, 1, k_max=0)
    with pytest.raises(ValueError):
        UtilityEstimator(2, 2).update(np.zeros((2, 3), dtype=np.int32))


def reference_algorithm1(freqs: list[np.ndarray], gamma: int, k_max: int, lam: float):
    """Algorithm 1 as written, one expert at a time, in exact rational arithmetic."""
    lam_f = Fraction(lam).limit_denominator(1000)
    shape = freqs[0].shape
    s = np.zeros(shape, dtype=int)
    up = np.full(shape, gamma // 2, dtype=int)
    down = np.full(shape, gamma // 2, dtype=int)
    prev = np.zeros(shape, dtype=int)
    history = []
    for f in freqs:
        for i in np.ndindex(shape):
            delta = int(f[i]) - int(prev[i])
            if delta >= up[i]:
                s[i] = min(k_max, s[i] + 1)
            elif -delta >= down[i]:
                s[i] = max(0, s[i] - 1)
            if delta > 0:
                up[i] = math.floor((1 - lam_f) * int(up[i]) + lam_f * delta)
            elif delta < 0:
                down[i] = math.floor((1 - lam_f) * int(down[i]) + lam_f * -delta)
        prev = f
        history.append((s.copy(), up.copy(), down.copy()))
    return history


@st.composite
def runs(draw):
    n_layer = draw(st.integers(1, 3))
    n_expert = draw(st.integers(1, 5))
    gamma = draw(st.integers(0, 12))
    k_max = draw(st.integers(1, 8))
    lam = draw(st.one_of(st.sampled_from([0.0, 0.05, 0.1, 0.25, 1.0]), st.floats(0.0, 1.0)))
    n_steps = draw(st.integers(1, 12))
    high = draw(st.sampled_from([gamma + 1, 3 * gamma + 3]))  # a verify batch, or more
    cells = draw(st.lists(st.integers(0, high), min_size=n_steps * n_layer * n_expert,
                          max_size=n_steps * n_layer * n_expert))
    freqs = list(np.array(cells, dtype=np.int32).reshape(n_steps, n_layer, n_expert))
    return n_layer, n_expert, gamma, k_max, lam, freqs


@settings(max_examples=150, deadline=None)
@given(runs())
def test_matches_reference_and_stays_in_range(run) -> None:
    n_layer, n_expert, gamma, k_max, lam, freqs = run
    est = UtilityEstimator(n_layer, n_expert, gamma=gamma, k_max=k_max, lam=lam)
    for f, (s, up, down) in zip(freqs, reference_algorithm1(freqs, gamma, k_max, lam)):
        out = est.update(f)
        assert out.dtype == np.uint8
        assert 0 <= out.min() and out.max() <= k_max
        assert est.theta_up.min() >= 0 and est.theta_down.min() >= 0
        np.testing.assert_array_equal(out, s)
        np.testing.assert_array_equal(est.theta_up, up)
        np.testing.assert_array_equal(est.theta_down, down)


@settings(max_examples=50, deadline=None)
@given(runs(), st.booleans())
def test_ablations_stay_in_range(run, binary: bool) -> None:
    n_layer, n_expert, gamma, k_max, lam, freqs = run
    est = UtilityEstimator(n_layer, n_expert, gamma=gamma, k_max=k_max, lam=lam,
                           adaptive=False, binary=binary)
    for f in freqs:
        out = est.update(f)
        assert out.max() <= est.k_max
        if binary:
            np.testing.assert_array_equal(out, f > 0)
        assert (est.theta_up == FIXED_THETA_UP).all() and (est.theta_down == FIXED_THETA_DOWN).all()


def test_frequency_counts_verified_tokens() -> None:
    """f_t as the estimator receives it: StepRouting.frequency over 3 tokens, 2 layers, top-2."""
    selected = np.array([[[0, 3], [1, 2]], [[3, 2], [1, 0]], [[3, 0], [2, 1]]], dtype=np.int32)
    freq = StepRouting(selected).frequency(4)
    assert freq.dtype == np.int32
    assert freq.tolist() == [[2, 0, 1, 3], [1, 3, 2, 0]]
