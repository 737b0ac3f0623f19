"""Models larger than the host RAM in the simulator: the host tier over the disk (sim/host_tier.py,
sim/disk.py), its limit, `spac sim run --host-ram` and the disk's measurement."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app as spac
from orchestrator.policies import make_policy
from orchestrator.sim import profiles
from orchestrator.sim.disk import Disk, measure_disk, write_measure_file
from orchestrator.sim.host_tier import DECAY, HOST_MARGIN, RankedTier
from orchestrator.sim.limit import limit
from orchestrator.sim.simulator import SimConfig, Simulator
from orchestrator.sim.synthetic import RoutingModel, synthesize_trace
from tests.test_sim_profile import MACHINE

POLICIES = ("static", "spac", "spac/host", "llama-moe-cache", "lru")
# a speculative trace and an autoregressive one, small enough for many runs
TRACES = {"speculative": dict(model=RoutingModel(n_layer=6, n_expert=32, top_k=4), gamma=4, acceptance=0.7),
          "autoregressive": dict(model=RoutingModel(n_layer=5, n_expert=16, top_k=2), gamma=0)}


@pytest.fixture(scope="module", params=sorted(TRACES))
def trace(request):
    return synthesize_trace(24, draft_fidelity=0.85, seed=5, **TRACES[request.param])


def ram_for(trace, share: float, config: SimConfig = SimConfig()) -> float:
    """Host RAM whose tier holds `share` of the trace's experts."""
    c = config.costs()
    return c.static_bytes + HOST_MARGIN + share * trace.n_layer * trace.n_expert * c.expert_bytes


def run(trace, policy: str, **config) -> object:
    return Simulator(trace, SimConfig(cache_ratio=0.2, **config)).run(make_policy(policy))


def test_unlimited_host_ram_changes_nothing(trace):
    for name in POLICIES:
        base = run(trace, name)
        for ram in (None, ram_for(trace, 1.0), 1e15):
            r = run(trace, name, host_ram=ram)
            np.testing.assert_array_equal(r.step_time, base.step_time, err_msg=name)
            assert r.host_slots is None and r.disk_bytes == 0 and r.prefetch_bytes == base.prefetch_bytes


def test_a_smaller_host_tier_is_never_faster(trace):
    for name in POLICIES:
        times = [run(trace, name, host_ram=ram_for(trace, s)).time_s for s in (1.0, 0.7, 0.45, 0.25, 0.1)]
        assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:])), (name, times)
        assert times[-1] > times[0], name  # the disk costs something


def test_a_read_ahead_of_every_needed_expert_never_stalls(trace):
    # room for a pass's experts besides the pool's (a read with no slot to land in is read again)
    ram = ram_for(trace, 0.6)
    for name in ("spac", "spac/host"):
        ahead = run(trace, name, host_ram=ram, read_ahead="next-pass", host_exclusive=False)
        none = run(trace, name, host_ram=ram, read_ahead="none", host_exclusive=False)
        assert ahead.disk_stalls == 0 and none.disk_stalls > 0, name
        assert ahead.time_s <= none.time_s * (1 + 1e-9), name
        # exclusive, what the pool evicts after the ranking is on the disk: fewer stalls, not none
        ahead = run(trace, name, host_ram=ram, read_ahead="next-pass")
        none = run(trace, name, host_ram=ram, read_ahead="none")
        assert ahead.disk_stalls < none.disk_stalls and ahead.time_s <= none.time_s * (1 + 1e-9), name


def test_the_tier_never_holds_what_the_device_pool_holds(trace, monkeypatch):
    """Exclusive: after every ranking (after each pass, each draft token) no expert is both in the
    host tier and in the pool, and the tier holds at most its slots."""
    calls = []

    def checked(method):
        def wrapper(tier, *args, **kwargs):
            method(tier, *args, **kwargs)
            assert not (tier.in_host & tier.device).any() and tier.in_host.sum() <= tier.slots, method.__name__
            calls.append(method.__name__)
        return wrapper

    for name in ("after_pass", "lookahead"):
        monkeypatch.setattr(RankedTier, name, checked(getattr(RankedTier, name)))
    for share in (0.6, 0.25):
        for name in ("spac", "spac/host"):
            r = run(trace, name, host_ram=ram_for(trace, share))
            assert r.host_slots is not None and r.disk_stalls > 0
    assert "after_pass" in calls


@pytest.mark.parametrize("cache_ratio, share", [(0.2, 0.2), (0.2, 0.4), (0.4, 0.4), (0.4, 0.6)])
def test_an_exclusive_tier_is_never_slower_where_the_pool_is_a_large_share_of_it(trace, cache_ratio, share):
    """The tier at most twice the pool (a 24 GB card beside 32 GB of RAM): the inclusive tier
    spends its slots on the pool's experts. (Where the tier is much larger than a pool that
    churns, the exclusive one can lose a few percent: an expert the pool evicts is on the disk.)"""
    for name in ("spac", "spac/host"):
        for rank in ("uses", "utility"):
            config = dict(cache_ratio=cache_ratio, host_ram=ram_for(trace, share), host_rank=rank)
            exclusive = Simulator(trace, SimConfig(**config)).run(make_policy(name))
            inclusive = Simulator(trace, SimConfig(**config, host_exclusive=False)).run(make_policy(name))
            assert exclusive.time_s <= inclusive.time_s * (1 + 1e-9), (name, rank)


def test_the_ranking_is_the_live_tiers():
    """The same passes, lookaheads and device pools give the live tier's holdings, exactly."""
    from orchestrator.runtime.host_tier import DECAY as LIVE_DECAY
    from orchestrator.runtime.host_tier import READ_AHEAD_OVER_UNIFORM as LIVE_OVER
    from orchestrator.runtime.host_tier import HostTier
    from orchestrator.sim.host_tier import READ_AHEAD_OVER_UNIFORM

    class FakeDisk:
        def advise(self, pairs, advice):
            return len(pairs)

        def set_on_device(self, on_device):
            pass

    n_layer, n_expert, k, capacity = 3, 16, 2, 12
    rng = np.random.default_rng(1)
    live = HostTier(FakeDisk(), n_layer, n_expert, capacity)
    device = np.zeros((n_layer, n_expert), dtype=bool)
    sim = RankedTier(n_layer, n_expert, capacity, Disk(4e9, 1e-4), 1.0, device, k)
    assert DECAY == LIVE_DECAY and READ_AHEAD_OVER_UNIFORM == LIVE_OVER
    for step in range(30):
        n_tokens = int(rng.integers(1, 4))
        ids = np.stack([np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tokens)])
                        for _ in range(n_layer)])  # [n_layer, n_tokens, k]
        device[...] = rng.random(device.shape) < 0.2
        live.after_pass(ids, device.copy())
        counts = np.zeros(device.shape)
        for m in range(n_layer):
            np.add.at(counts[m], ids[m].ravel(), 1)
        sim.after_pass(counts, float(step))
        np.testing.assert_array_equal(sim.in_host, live.resident, err_msg=f"pass {step}")
        drafted = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_layer)])[:, None, :]
        live.lookahead(drafted)
        chose = np.zeros(device.shape, dtype=bool)
        chose[np.arange(n_layer)[:, None], drafted[:, 0, :]] = True
        sim.lookahead(chose, step + 0.5)
        np.testing.assert_array_equal(sim.in_host, live.resident, err_msg=f"lookahead {step}")


def test_a_faster_disk_is_never_slower(trace, monkeypatch):
    disks = [Disk(gbps * 1e9, latency_us * 1e-6, 32) for gbps, latency_us in ((0.5, 200), (3.5, 80), (7.0, 80),
                                                                               (7.0, 20))]
    ram = ram_for(trace, 0.3)
    for name in POLICIES:
        times = []
        for d in disks:
            sim = Simulator(trace, SimConfig(cache_ratio=0.2, host_ram=ram))
            sim.costs = replace(sim.costs, disk=d)
            times.append(sim.run(make_policy(name)).time_s)
        assert all(a >= b * (1 - 1e-9) for a, b in zip(times, times[1:])), (name, times)


@pytest.mark.parametrize("share, hardware", [(0.5, "rtx4090"), (0.2, "rtx4060"), (0.05, "rtx4060")])
def test_the_limit_bounds_every_policy_with_the_disk(trace, share, hardware):
    config = SimConfig(cache_ratio=0.2, hardware=hardware, host_ram=ram_for(trace, share, SimConfig(hardware=hardware)),
                       disk="nvme-pcie3")
    sim = Simulator(trace, config)
    bound = limit(trace, sim.capacity, sim.costs, host_slots=sim.host_slots)
    assert sim.host_slots is not None
    assert bound.time_s > limit(trace, sim.capacity, sim.costs).time_s * (1 - 1e-9)
    for name in POLICIES + ("lru/host", "hybrimoe", "moe-spac-paper", "belady"):
        r = sim.run(make_policy(name))
        assert (r.step_time >= bound.step_time * (1 - 1e-9)).all(), name
        assert r.tokens_per_s <= bound.tokens_per_s * (1 + 1e-9), name


def test_disk_times():
    d = Disk(4e9, 100e-6, 4)
    assert d.read_s(0, 0) == 0
    assert d.read_s(4, 4e6) == pytest.approx(100e-6 + 1e-3)      # one round of latency
    assert d.read_s(5, 5e6) == pytest.approx(200e-6 + 1.25e-3)   # two
    # 1 MiB by faults: 8 windows of 128 KiB, each 100 µs + 32.8 µs, 4 at a time
    assert d.fault_s(1, 1 << 20, threads=4) == pytest.approx(8 * (100e-6 + (128 << 10) / 4e9) / 4)
    assert d.fault_s(1, 1 << 20, threads=64) == pytest.approx(8 * (100e-6 + (128 << 10) / 4e9) / 4)  # the queue
    assert Disk(4e9, 0.0, 32).fault_s(2, 1 << 20, threads=32) == pytest.approx(2 * (1 << 20) / 4e9)  # the rate


def test_disk_presets_and_measured_profile(tmp_path):
    assert profiles.disk("nvme-pcie3").read_bytes_per_s == 3.5e9
    assert profiles.disk("nvme-pcie4").read_bytes_per_s == 7e9
    assert "disks" not in profiles.hardware_profiles()
    path = write_measure_file(tmp_path / "disk.bin", 24 << 20)
    d = measure_disk(path)
    assert d.read_bytes_per_s > 1e6 and 0 < d.latency_s < 0.1 and d.queue_depth >= 1
    # the measured profile carries it
    written = profiles.write_measured(tmp_path / "m.toml", replace(MACHINE, disk=d))
    assert profiles.read_measured(written).disk == d


def test_cli_host_ram():
    runner = CliRunner()
    r = runner.invoke(spac, ["sim", "run", "--steps", "6", "-p", "static", "-p", "spac", "--host-ram", "16GiB",
                             "--disk", "nvme-pcie3"])
    assert r.exit_code == 0, r.output
    assert "host tier:" in r.output and "GB read" in r.output
    r = runner.invoke(spac, ["sim", "run", "--steps", "6", "-p", "static", "--host-ram", "banana"])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("spac: error: --host-ram 'banana'"), r.output
    r = runner.invoke(spac, ["sim", "run", "--steps", "6", "-p", "static", "--host-ram", "16G", "--disk", "floppy"])
    assert r.exit_code == 2 and "--disk 'floppy'" in r.output
