"""RunRecorder / RunMetrics on hand-made runs with a fake clock."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orchestrator.decoding.metrics import RunRecorder


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stats(dev=0, cpu=0, copied=0, copies=0):
    return {"n_expert_tokens_device": dev, "n_expert_tokens_cpu": cpu, "bytes_copied": copied,
            "n_copies": copies, "n_evictions": 0, "n_prefetch_late": 0, "bytes_staged": 0}


def test_speed_and_speculation_numbers():
    clock = Clock()
    rec = RunRecorder(clock=clock)
    rec.start(n_prompt_tokens=10)
    clock.t += 0.5
    rec.prefill_done()
    clock.t += 0.1
    rec.step(n_drafted=4, n_accepted=3)
    rec.emitted(4)  # first tokens at 0.6 s
    clock.t += 0.1
    rec.step(n_drafted=4, n_accepted=1)
    rec.emitted(2)
    clock.t += 0.2
    rec.step(n_drafted=4, n_accepted=0)
    rec.emitted(1)
    clock.t += 0.05  # after the last token: not decode time
    m = rec.finish("length")
    assert m.ttft_s == pytest.approx(0.6)
    assert m.prefill_s == pytest.approx(0.5)
    assert m.decode_s == pytest.approx(0.4)
    assert m.n_tokens == 7 and m.n_steps == 3
    assert m.tokens_per_s == pytest.approx(7 / 0.4)
    assert m.latency_ms == pytest.approx(400 / 7)
    assert m.acceptance_rate == pytest.approx(4 / 12)
    assert m.tokens_per_step == pytest.approx(7 / 3)
    assert m.device_share is None and m.tau_histogram is None and m.hot_cold_accuracy is None
    line = m.summary()
    assert "7 tokens" in line and "17.5 tok/s" in line and "accept 0.33" in line and "\n" not in line
    assert json.loads(m.to_json())["n_tokens"] == 7


def test_engine_counters_are_deltas_of_this_run():
    rec = RunRecorder(n_layer=2, n_expert=4, k_max=4, clock=Clock())
    rec.start(3, stats(dev=100, cpu=50, copied=1000, copies=1))
    rec.engine_stats(stats(dev=130, cpu=60, copied=3000, copies=3))
    assert rec.live()["device_share"] == pytest.approx(0.75)
    m = rec.finish("eos", stats(dev=160, cpu=70, copied=5000, copies=5))
    assert m.n_expert_tokens_device == 60 and m.n_expert_tokens_cpu == 20
    assert m.device_share == pytest.approx(0.75)
    assert m.bytes_copied == 4000 and m.n_copies == 4
    assert "device 75% of expert tokens" in m.summary() and "4.0 KB copied" in m.summary()


def test_tau_histogram_per_layer():
    rec = RunRecorder(n_layer=3, n_expert=4, k_max=4, clock=Clock())
    rec.start(1)
    for tau in ([1, 2, 4], [1, 3, 4], [2, 3, 4]):
        rec.plan(np.array(tau, dtype=np.int32), 1e-4)
    m = rec.finish()
    assert m.tau_histogram == [[2, 1, 0, 0], [0, 1, 2, 0], [0, 0, 0, 3]]
    assert m.orchestrator_ms_median == pytest.approx(0.1)


def test_hot_cold_accuracy_as_in_the_paper():
    """predicted hot: utility >= τ; actual hot: frequency in the next step >= τ."""
    rec = RunRecorder(n_layer=2, n_expert=4, k_max=4, clock=Clock())
    rec.start(1)
    utility = np.array([[4, 2, 0, 1], [3, 3, 0, 0]], dtype=np.uint8)
    tau = np.array([2, 1], dtype=np.int32)
    # layer 0 (τ=2): predicted hot [T, T, F, F]; freq [5, 1, 0, 2] → actual [T, F, F, T]: 2/4 right
    # layer 1 (τ=1): predicted hot [T, T, F, F]; freq [1, 0, 0, 0] → actual [T, F, F, F]: 3/4 right
    freq = np.array([[5, 1, 0, 2], [1, 0, 0, 0]], dtype=np.int32)
    rec.hot_cold(utility, tau, freq)
    # a perfect step
    rec.hot_cold(utility, tau, np.array([[2, 2, 0, 0], [1, 1, 0, 0]], dtype=np.int32))
    m = rec.finish()
    assert m.hot_cold_accuracy_per_layer == [pytest.approx(6 / 8), pytest.approx(7 / 8)]
    assert m.hot_cold_accuracy == pytest.approx(13 / 16)


def test_nothing_generated():
    rec = RunRecorder(clock=Clock())
    rec.start(5)
    m = rec.finish("interrupted")
    assert m.n_tokens == 0 and m.tokens_per_s == 0.0 and m.ttft_s is None and m.acceptance_rate is None
    assert "stop: interrupted" in m.summary()
